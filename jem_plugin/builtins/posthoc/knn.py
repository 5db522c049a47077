"""Deep nearest neighbours (Sun et al. 2022)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _memory
from ._base import _RowBank


@functools.cache
def _faiss() -> Any:
    """The faiss module where it is installed (the ``knn`` extra), else ``None``."""
    try:
        import faiss  # optional: the knn extra
    except ImportError:
        return None
    return faiss


class KNN(_RowBank):
    """Deep nearest neighbours (Sun et al. 2022): ``score(z) = -||z/|z| - n_k||``, minus the
    Euclidean distance from the normalised features to their ``k``-th nearest normalised training
    feature. ``fit`` keeps the normalised training features (``N x D`` floats), or a uniform
    subsample of ``max_fit`` of them (the paper uses 1% of ImageNet). Neighbours are searched in
    chunks of ``chunk`` training rows, so scoring memory stays ``B x chunk``; the distance of the
    chosen neighbour is then computed directly (not from the dot product).

    ``search``: ``"auto"`` (default) searches a bank on the CPU with faiss's exact inner-product
    index where faiss is installed (``pip install jem-plugin[knn]``: several times faster on
    large banks, the same neighbours up to ties, the bank shared with the index, not copied),
    else, and on a GPU, by chunked matrix products; ``"torch"`` always the latter, ``"faiss"``
    requires faiss. Memory: ``N x D`` float32 (a fit of 1.28M ImageNet features of 2048 holds
    10.5 GB and is refused under the default 2 GB ``memory_limit``, naming the ``max_fit`` that
    fits; see the post-hoc guide's "Large data")."""

    name = "knn"
    _memory_formula = staticmethod(_memory.knn)  # the fit's peak
    description = "minus the distance to the k-th nearest normalised training feature (fit; k=50, max_fit=)"
    paper = "Sun et al. 2022, Out-of-Distribution Detection with Deep Nearest Neighbors (ICML)"

    def __init__(
        self, k: int = 50, max_fit: int | None = None, seed: int = 0, chunk: int = 65536, search: str = "auto"
    ) -> None:
        super().__init__()
        k = self._checked_k(k)
        if search not in ("auto", "torch", "faiss"):
            raise ValueError(f"search must be 'auto', 'torch' or 'faiss', got {search!r}")
        if search == "faiss" and _faiss() is None:
            raise ImportError("knn search='faiss' needs faiss: pip install jem-plugin[knn] (faiss-cpu)")
        self.k, self.max_fit, self.seed, self.chunk, self.search = k, max_fit, seed, int(chunk), search

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        self._bank_add(F.normalize(feats, dim=1))

    def _finish(self, jm: Any) -> None:
        self.bank = self._take_bank()
        self._index = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if state.pop("_index", None) is not None:  # rebuilt from the bank on the first search
            state["bank"] = self.bank.clone()  # a tensor of its own, not a view of the index
        return state

    def _faiss_index(self) -> Any:
        """faiss's exact inner-product index over the bank, built once; the bank then lives in
        the index's storage (viewed as a tensor, not copied)."""
        index = self.__dict__.get("_index")
        if index is None:
            faiss = _faiss()
            assert faiss is not None
            bank = self.bank.float().contiguous()
            index = faiss.IndexFlatIP(bank.shape[1])
            index.add(bank.numpy())
            n, d = bank.shape
            view = torch.from_numpy(faiss.rev_swig_ptr(index.get_xb(), n * d).reshape(n, d))
            view._faiss_index = index  # type: ignore[attr-defined]  # the view keeps the storage it views alive
            self.bank, self._index = view, index
        return index

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        z = F.normalize(feats, dim=1)
        use_faiss = self.search == "faiss" or (self.search == "auto" and _faiss() is not None)
        if use_faiss and z.device.type == "cpu" and self.bank.device.type == "cpu":
            _, idx = self._faiss_index().search(z.float().contiguous().numpy(), self.k)
            kth = self.bank[torch.from_numpy(idx[:, self.k - 1])]
            return -(z - kth.to(z.dtype)).norm(dim=1)
        bank = self.bank.to(z.device)
        best_sim: Tensor | None = None
        best_idx: Tensor | None = None
        for start in range(0, bank.shape[0], self.chunk):
            sims = z @ bank[start : start + self.chunk].T
            kk = min(self.k, sims.shape[1])
            s, i = sims.topk(kk, dim=1)
            i = i + start
            if best_sim is not None and best_idx is not None:
                s, j = torch.cat([best_sim, s], 1).topk(min(self.k, best_sim.shape[1] + kk), dim=1)
                i = torch.cat([best_idx, i], 1).gather(1, j)
            best_sim, best_idx = s, i
        assert best_idx is not None
        kth = bank[best_idx[:, self.k - 1]]
        return -(z - kth).norm(dim=1)
