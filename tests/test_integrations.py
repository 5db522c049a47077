"""JEM inside the trainers users already run: timm's task API, Lightning, Accelerate (CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, TinyCNN
from torch.utils.data import DataLoader, TensorDataset

import jem_plugin as jem
from jem_plugin.errors import InvalidLabelError


def _digits_like(n: int = 32, k: int = 10, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, k, (n,), generator=g))


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else True for k in a)


# =============================================================================== timm
timm_task = pytest.importorskip("jem_plugin.integrations.timm_task", reason="this timm has no task API (timm.task)")


def _timm_task(num_classes=5, device="cpu", **kwargs):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", pretrained=False, num_classes=num_classes)
    kwargs.setdefault("sampler", jem.SGLD(steps=2, generator=torch.Generator(device=device).manual_seed(0)))
    kwargs.setdefault("buffer", jem.ReplayBuffer(32, (3, 32, 32)))
    return timm_task.JEMTask(model, verbose=False, device=torch.device(device), **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_timm_task_trains_test_resnet_and_round_trips_through_timm_checkpoints(tmp_path, device):
    import timm
    import timm.optim
    from timm.task import TrainingTask, resume_task_checkpoint
    from timm.utils import CheckpointSaver

    task = _timm_task(device=device)
    assert isinstance(task, TrainingTask)
    opt = timm.optim.create_optimizer_v2(task.get_trainable_module(), "adamw", lr=1e-3)
    before = [p.detach().clone() for p in task.jem.parameters()]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.rand(4, 3, 32, 32, generator=g) * 2 - 1, torch.randint(0, 5, (4,), generator=g)
        x, y = x.to(device), y.to(device)
        with task.no_sync():  # timm's accumulation context: a no-op in one process
            result = task(x, y)
            result["loss"].backward()
        opt.step()
        opt.zero_grad()
    # timm's contract: 'loss' to backpropagate, 'output' the logits; JEM's metrics as tensors.
    assert result["loss"].dim() == 0 and torch.isfinite(result["loss"])
    assert result["output"].shape == (4, 5)
    for key in ("ce", "px", "energy_data", "energy_sample", "energy_gap"):
        assert isinstance(result[key], torch.Tensor) and result[key].dim() == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, task.jem.parameters()))
    assert bool(task.jem_loss.buffer.initialized)

    # Validation and saved weights use the bare timm classifier.
    eval_model = task.get_eval_model()
    assert type(eval_model).__name__ == "ResNet" and eval_model is task.jem.model

    saver = CheckpointSaver(
        model=eval_model, optimizer=opt, task=task, checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path)
    )
    saver.save_recovery(epoch=0, batch_idx=3)
    path = saver.find_recovery()
    assert path
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert "jem_loss" in ckpt["task_state"]
    plain = timm.create_model("test_resnet", pretrained=False, num_classes=5)
    plain.load_state_dict(ckpt["state_dict"])  # a JEM checkpoint is a timm checkpoint

    fresh = _timm_task(device=device, sampler=jem.SGLD(steps=2), buffer=jem.ReplayBuffer(32, (3, 32, 32)))
    fresh_opt = timm.optim.create_optimizer_v2(fresh.get_trainable_module(), "adamw", lr=1e-3)
    resume_task_checkpoint(fresh, path, optimizer=fresh_opt, log_info=False)
    assert _state_equal(fresh.jem.state_dict(), task.jem.state_dict())
    assert torch.equal(fresh.jem_loss.buffer.data, task.jem_loss.buffer.data)
    assert torch.equal(fresh.jem_loss.sampler.generator.get_state(), task.jem_loss.sampler.generator.get_state())


def test_timm_task_with_timm_criterion_and_mixup_targets():
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    x = torch.rand(4, 3, 32, 32) * 2 - 1
    soft = torch.softmax(torch.randn(4, 5), 1)  # what mixup/cutmix hand the task
    with pytest.raises(InvalidLabelError, match="criterion"):
        _timm_task()(x, soft)
    task = _timm_task(criterion=SoftTargetCrossEntropy())
    assert task.jem_loss.ce_weight == 0.0  # the criterion is the p(y|x) term
    out = task(x, soft)
    expected_ce = SoftTargetCrossEntropy()(out["output"], soft)
    # loss = criterion + px term (no energy L2 here)
    assert torch.allclose(out["loss"], expected_ce + out["px"], atol=1e-5)
    task = _timm_task(criterion=LabelSmoothingCrossEntropy(0.1))
    assert torch.isfinite(task(x, torch.tensor([0, 1, 2, 3]))["loss"])
    with pytest.raises(ValueError, match="ce_weight"):
        _timm_task(criterion=SoftTargetCrossEntropy(), ce_weight=1.0)


def test_timm_task_ema_eval_model_is_the_bare_classifier():
    task = _timm_task()
    task.setup_ema(decay=0.9)
    task.update_ema(step=1)
    assert type(task.get_eval_model(ema=True)).__name__ == "ResNet"
    assert task.get_eval_model(ema=True) is not task.jem.model
    assert task.get_task_state(ema=True) == {}  # buffers are not averaged


# =============================================================================== Lightning
def _lightning():
    return pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install lightning)")


def _trainer(pl, root, device="cpu", **kwargs):
    kwargs.setdefault("max_steps", 2)
    return pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        **kwargs,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_lightning_module_fits_validates_under_inference_mode_and_checkpoints(tmp_path, device):
    pl = _lightning()
    from jem_plugin.integrations.lightning import JEMLightningModule

    class Recording(JEMLightningModule):
        def validation_step(self, batch, batch_idx):
            self.seen_modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
            return super().validation_step(batch, batch_idx)

    def make(model=None):
        return Recording(
            model or TinyCNN(),
            lr=1e-3,
            val_scores=("logpx", "grad_norm"),
            val_sgld_steps=2,
            sampler=jem.SGLD(steps=2),
            buffer=jem.ReplayBuffer(64, (1, 8, 8)),
            wrap_options={"data_range": (-1.0, 1.0), "input_size": (1, 8, 8)},
            px_weight=1.0,
            l2_weight=0.1,
        )

    module = make()
    module.seen_modes = []
    assert "jem_loss.buffer.data" in module._ddp_params_and_buffers_to_ignore
    train = DataLoader(_digits_like(32), batch_size=8)
    val = DataLoader(_digits_like(16, seed=1), batch_size=8)
    trainer = _trainer(pl, tmp_path, device, val_check_interval=2)
    trainer.fit(module, train, val)
    m = dict(trainer.callback_metrics)
    # Validation inside fit runs under no_grad, trainer.validate under inference_mode: gradient
    # scores and SGLD work under both.
    m.update(trainer.validate(module, val, verbose=False)[0])
    assert module.seen_modes == [(False, False), (True, False)]
    for key in ("val/acc", "val/grad_norm", "val/energy_sample", "train/loss"):
        assert key in m and torch.isfinite(torch.as_tensor(m[key])), key
    assert bool(module.jem_loss.buffer.initialized)

    path = tmp_path / "jem.ckpt"
    trainer.save_checkpoint(path)
    loaded = Recording.load_from_checkpoint(
        path, model=TinyCNN(), sampler=jem.SGLD(steps=2), buffer=jem.ReplayBuffer(64, (1, 8, 8))
    )
    assert torch.equal(loaded.jem_loss.buffer.data, module.jem_loss.buffer.data)
    assert _state_equal(loaded.model.state_dict(), module.model.state_dict())
    assert loaded.hparams.l2_weight == 0.1

    # Resume training from the checkpoint: the buffer continues from the saved chains.
    resumed = make()
    _trainer(pl, tmp_path / "resumed", device, max_steps=3).fit(resumed, train, val, ckpt_path=str(path))
    assert resumed.trainer.global_step == 3


def test_lightning_gradient_scores_and_sgld_inside_inference_mode():
    _lightning()
    from jem_plugin.integrations.lightning import JEMLightningModule

    module = JEMLightningModule(
        TinyCNN(),
        sampler=jem.SGLD(steps=3),
        buffer=jem.ReplayBuffer(16, (1, 8, 8)),
        wrap_options={"data_range": (-1.0, 1.0), "input_size": (1, 8, 8)},
    )
    module.eval()
    with torch.inference_mode():
        x = torch.rand(4, 1, 8, 8) * 2 - 1  # an inference tensor, as Lightning's batches are
        scores = module.jem_score(x, "grad_norm")
        samples = module.jem_sample(4)
        chained = module.jem_sample(4, use_buffer=True)
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    assert samples.shape == chained.shape == (4, 1, 8, 8) and torch.isfinite(samples).all()
    assert bool(module.jem_loss.buffer.initialized)


def test_lightning_loads_this_ranks_buffer_from_a_per_rank_checkpoint():
    _lightning()
    from jem_plugin.distributed import PER_RANK_FORMAT
    from jem_plugin.integrations.lightning import PER_RANK_KEY, JEMLightningModule

    module = JEMLightningModule(
        TinyCNN(),
        sampler=jem.SGLD(steps=1),
        buffer=jem.ReplayBuffer(8, (1, 8, 8)),
        wrap_options={"data_range": (-1.0, 1.0), "input_size": (1, 8, 8)},
    )
    state = module.state_dict()
    own = {
        k[len("jem_loss.") :]: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
        if k.startswith("jem_loss.")
    }
    own["buffer.data"] = torch.full_like(own["buffer.data"], 7.0)
    checkpoint = {
        "state_dict": dict(state),
        PER_RANK_KEY: {"format": PER_RANK_FORMAT, "world_size": 1, "states": [own]},
    }
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"])
    assert torch.equal(module.jem_loss.buffer.data, torch.full((8, 1, 8, 8), 7.0))


# =============================================================================== Accelerate
@pytest.mark.parametrize("device", DEVICES)
def test_accelerate_save_state_restores_the_replay_buffer(tmp_path, device):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate)")
    from jem_plugin.integrations.accelerate import register_jem_state

    accelerator = accelerate.Accelerator(cpu=device == "cpu", project_dir=str(tmp_path))
    jm = jem.wrap(TinyCNN(), data_range=(-1.0, 1.0), input_size=(1, 8, 8))
    opt = torch.optim.Adam(jm.parameters(), lr=1e-3)
    loader = DataLoader(_digits_like(16), batch_size=8)
    jm, opt, loader = accelerator.prepare(jm, opt, loader)
    loss_fn = jem.JEMLoss(
        jem.SGLD(steps=2, generator=torch.Generator(device=device).manual_seed(0)), jem.ReplayBuffer(32, (1, 8, 8))
    )
    (wrapper,) = register_jem_state(accelerator, loss_fn)
    for x, y in loader:
        with accelerator.accumulate(jm):
            out = loss_fn(jm, x, y)
            accelerator.backward(out.loss)
            opt.step()
            opt.zero_grad()
    accelerator.save_state(str(tmp_path / "state"))
    saved_buffer = loss_fn.buffer.data.clone()
    saved_gen = loss_fn.sampler.generator.get_state()
    stored = torch.load(tmp_path / "state" / "custom_checkpoint_0.pkl", weights_only=True)
    on_disk = stored["states"][0]["buffer.data"]
    assert stored["world_size"] == 1 and on_disk.device.type == "cpu"  # a checkpoint that loads on any machine
    assert torch.equal(on_disk, saved_buffer.cpu())

    for x, y in loader:  # move on, then come back
        loss_fn(jm, x, y)
    assert not torch.equal(loss_fn.buffer.data, saved_buffer)
    accelerator.load_state(str(tmp_path / "state"))
    assert torch.equal(loss_fn.buffer.data, saved_buffer)
    assert torch.equal(loss_fn.sampler.generator.get_state(), saved_gen)
    with pytest.raises(ValueError):
        register_jem_state(accelerator)
