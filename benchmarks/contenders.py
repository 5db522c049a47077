"""The other implementations we measure ourselves against, on the same model, energy and batch.

(a) ``ReferenceJEM``: the sampling loop and training step of the reference JEM code
    (wgrathwohl/JEM, ``train_wrn_ebm.py``: ``init_random``, ``sample_p_0``, ``sample_q`` and the
    body of the training loop), re-expressed here operation for operation so that it costs what
    the original costs:

    - the replay buffer is a CPU tensor initialised uniform in [-1, 1];
    - ``sample_p_0`` draws ``randint`` slots, draws a full batch of fresh uniform samples, mixes
      them with a float mask ``choose * fresh + (1 - choose) * stored`` and moves the result to
      the device;
    - ``sample_q`` switches the model to eval, makes the start a leaf requiring grad, and runs
      ``steps`` x ``grad(f(x).sum(), x, retain_graph=True)`` with
      ``x.data += lr * grad + std * randn_like(x)``; then switches the model to train and writes
      the chains back to the CPU buffer;
    - the parameters keep ``requires_grad=True`` during sampling (the reference never freezes
      them), so autograd records the parameter path too;
    - the training step does three separate forwards (data for p(x), samples, labelled data for
      p(y|x)), checks ``|L| > 1e8`` with a host sync, then zero_grad / backward / step.
    The reference's model is ``CCF``: ``f(x) = logsumexp(classify(x))``; here ``classify`` is the
    benchmarked classifier itself.

(b) ``torchebm_sampler``: torchebm's ``LangevinDynamics`` (Euler-Maruyama integrator) on the energy
    ``E(x) = -logsumexp f(x)``, configured to make exactly the JEM update: torchebm's step is
    ``x - h * dE/dx + sqrt(2 h) * noise_scale * N(0, I)``, so ``h = step_size`` and
    ``noise_scale = noise / sqrt(2 h)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ReferenceJEM:
    """Reference JEM sampler + training step (see the module docstring for what is reproduced)."""

    def __init__(
        self,
        model: nn.Module,
        sample_shape: Sequence[int],
        *,
        buffer_size: int = 10000,
        reinit_freq: float = 0.05,
        sgld_lr: float = 1.0,
        sgld_std: float = 0.01,
        n_steps: int = 20,
        batch_size: int = 64,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model = model
        self.sample_shape = tuple(sample_shape)
        self.reinit_freq = reinit_freq
        self.sgld_lr = sgld_lr
        self.sgld_std = sgld_std
        self.n_steps = n_steps
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.replay_buffer = self.init_random(buffer_size)  # lives on the CPU, as in the reference

    def f(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        """``CCF.forward``: logsumexp of the logits (or the logit of ``y``)."""
        logits = self.model(x)
        if y is None:
            return logits.logsumexp(1)
        return torch.gather(logits, 1, y[:, None])

    def init_random(self, bs: int) -> Tensor:
        return torch.FloatTensor(bs, *self.sample_shape).uniform_(-1, 1)

    def sample_p_0(self, bs: int) -> tuple[Tensor, Tensor]:
        buffer_size = len(self.replay_buffer)
        inds = torch.randint(0, buffer_size, (bs,))
        buffer_samples = self.replay_buffer[inds]
        random_samples = self.init_random(bs)
        mask_shape = (bs,) + (1,) * len(self.sample_shape)
        choose_random = (torch.rand(bs) < self.reinit_freq).float().view(mask_shape)
        samples = choose_random * random_samples + (1 - choose_random) * buffer_samples
        return samples.to(self.device), inds

    def sample_q(self, n_steps: int | None = None) -> Tensor:
        n_steps = self.n_steps if n_steps is None else n_steps
        self.model.eval()
        init_sample, buffer_inds = self.sample_p_0(self.batch_size)
        x_k = torch.autograd.Variable(init_sample, requires_grad=True)
        for _ in range(n_steps):
            f_prime = torch.autograd.grad(self.f(x_k).sum(), [x_k], retain_graph=True)[0]
            x_k.data += self.sgld_lr * f_prime + self.sgld_std * torch.randn_like(x_k)
        self.model.train()
        final_samples = x_k.detach()
        self.replay_buffer[buffer_inds] = final_samples.cpu()
        return final_samples

    def train_step(
        self,
        optim: torch.optim.Optimizer,
        x_p_d: Tensor,
        x_lab: Tensor,
        y_lab: Tensor,
        p_x_weight: float = 1.0,
        p_y_given_x_weight: float = 1.0,
    ) -> float:
        L = 0.0
        x_q = self.sample_q()
        fp_all = self.f(x_p_d)
        fq_all = self.f(x_q)
        l_p_x = -(fp_all.mean() - fq_all.mean())
        L += p_x_weight * l_p_x
        logits = self.model(x_lab)  # CCF.classify
        L += p_y_given_x_weight * nn.CrossEntropyLoss()(logits, y_lab)
        if L.abs().item() > 1e8:
            raise FloatingPointError("reference loop: loss diverged")  # the reference does 1/0
        optim.zero_grad()
        L.backward()
        optim.step()
        return float(L.detach())


def torchebm_sampler(model: nn.Module, step_size: float = 1.0, noise: float = 0.01):
    """torchebm's ``LangevinDynamics`` making the JEM update on ``E(x) = -logsumexp f(x)``.

    Returns ``(sampler, energy_model)``; call ``sampler.sample(x=x0, n_steps=steps)``.
    """
    from torchebm.core import BaseModel
    from torchebm.samplers import LangevinDynamics

    class LogsumexpEnergy(BaseModel):
        """``E(x) = -logsumexp_y f(x)[y]``: the JEM marginal energy as a torchebm model."""

        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Tensor) -> Tensor:
            return -torch.logsumexp(self.net(x), dim=1)

    energy = LogsumexpEnergy(model)
    sampler = LangevinDynamics(energy, step_size=step_size, noise_scale=noise / math.sqrt(2.0 * step_size))
    return sampler, energy


def plain_ce_step(model: nn.Module, optim: torch.optim.Optimizer, x: Tensor, y: Tensor) -> float:
    """The baseline: one cross-entropy training step."""
    loss = F.cross_entropy(model(x), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(loss.detach())
