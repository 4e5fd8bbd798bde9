"""DeepSpeed checkpoint files read for the weights alone: what an engine built
``weights_only`` (``DeepSpeedTrainEngine``, the actor of ``oppo-train --evaluate``) loads,
from a tag of any ZeRO stage and number of ranks, without DeepSpeed's own load.

Nothing here imports deepspeed at module level: the engine module, which chooses DeepSpeed's
accelerator before the first import, calls in.
"""
from __future__ import annotations

import bisect
import itertools
import os
import re
from typing import TYPE_CHECKING

import torch

from oppo_ds.engines.base import CheckpointMismatch

if TYPE_CHECKING:
    import deepspeed



def tag_folder(ckpt_dir: str, tag: str | None) -> str:
    """``ckpt_dir/tag`` (``tag=None``: the one ``latest`` names); ``FileNotFoundError`` if
    there is no such checkpoint."""
    if tag is None:
        latest = os.path.join(ckpt_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {ckpt_dir!r} (tag=None)")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(ckpt_dir, str(tag))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no DeepSpeed checkpoint in {ckpt_dir!r} (tag={tag!r})")
    return folder


def _mapped(path: str) -> dict:
    """A DeepSpeed checkpoint file, memory-mapped: the pages of what is not taken from it
    (the optimizer's moments, other ranks' slices) are never read."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


class SavedWeights:
    """The weights of one DeepSpeed checkpoint tag, read by element range, whichever ZeRO
    stage and number of ranks wrote it; files memory-mapped and opened when first read from,
    so only the ranges read are paged in.

    ZeRO-0/1/2 write the whole module (in the training dtype) in ``mp_rank_00_model_states.pt``.
    ZeRO-3 writes, per rank, a model file (frozen parameters' partitions in
    ``frozen_param_fragments``, the order of the trained ones in ``param_shapes``) and an
    optimizer file whose ``fp32_flat_groups`` hold the rank's fp32 master partitions: one flat
    tensor per sub-group, each parameter's partition (``ceil(numel / ranks)`` elements, the
    last ranks' padded) one after another in ``param_shapes`` order, the same offsets on every
    rank (DeepSpeed's ``zero_to_fp32`` reads them so). DeepSpeed's own weights-only load
    (``load_module_only``) assembles the whole fp32 model on every rank, of the tag ``latest``
    names; reading ranges lets each rank take its own slices alone (from its own files when
    the checkpoint has as many ranks). ``rank``: whose model file gives the layout.

    Raises ``CheckpointMismatch`` for files of another layout, ``FileNotFoundError`` for
    missing ones.
    """

    def __init__(self, folder: str, rank: int = 0) -> None:
        self.folder = folder
        files = os.listdir(folder)
        if "mp_rank_00_model_states.pt" in files:
            state = _mapped(os.path.join(folder, "mp_rank_00_model_states.pt"))
            if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
                raise CheckpointMismatch(f"{folder}/mp_rank_00_model_states.pt holds no "
                                         f"'module' state dict: not a DeepSpeed model file")
            self.module = state["module"]  # name -> tensor: buffers and ties too
            self.ranks = None
            return
        ranks = sorted(int(m.group(1)) for m in (
            re.fullmatch(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt", f) for f in files)
            if m)
        self.ranks = len(ranks)
        if not ranks or ranks != list(range(self.ranks)):
            raise FileNotFoundError(
                f"{folder} holds no whole DeepSpeed checkpoint: mp_rank_00_model_states.pt "
                f"(ZeRO-0/1/2) or zero_pp_rank_K_mp_rank_00_model_states.pt for K = 0, 1, ... "
                f"(ZeRO-3) was expected; the ranks' files there: {ranks}")
        self._optim_files = []
        for k in range(self.ranks):
            name = f"zero_pp_rank_{k}_mp_rank_00_optim_states.pt"
            found = [f for f in files if f.endswith(name)]  # a bf16_ prefix or none
            if len(found) != 1:
                raise FileNotFoundError(f"{folder}: one ZeRO-3 optimizer file *{name} was "
                                        f"expected (rank {k}'s partitions), found {found}")
            self._optim_files.append(os.path.join(folder, found[0]))
        self._models, self._groups, self._bounds = {}, {}, None
        layout = self._model(min(rank, self.ranks - 1))
        if not isinstance(layout, dict):
            raise CheckpointMismatch(f"{folder}: a ZeRO-3 model file holds no dict: not a "
                                     f"DeepSpeed checkpoint")
        if layout.get("dp_world_size", self.ranks) != self.ranks:
            raise CheckpointMismatch(
                f"{folder} holds the files of {self.ranks} ranks, written by "
                f"{layout['dp_world_size']}: some are missing or left from another save")
        try:
            trained = layout["param_shapes"]
            self.shapes = {n: torch.Size(s) for group in trained for n, s in group.items()}
            self.shapes.update({n: torch.Size(s)
                                for n, s in (layout.get("frozen_param_shapes") or {}).items()})
            buffers = set(layout.get("buffer_names") or [])
            self.module = {n: t for n, t in layout["module"].items() if n in buffers}
        except (KeyError, AttributeError, TypeError) as err:
            raise CheckpointMismatch(f"{folder}: a ZeRO-3 model file of a layout this reader "
                                     f"does not know (DeepSpeed {layout.get('ds_version')}): "
                                     f"{err!r}") from None
        self._offsets, offset = {}, 0
        for group in trained:
            for n, shape in group.items():
                self._offsets[n] = offset
                offset += self._partition(torch.Size(shape).numel())
        self._flat_groups(min(rank, self.ranks - 1))  # sets the sub-groups' bounds
        if self._bounds[-1] != offset:
            raise CheckpointMismatch(
                f"{folder}: the fp32 partitions hold {self._bounds[-1]} elements per rank, the "
                f"parameters' partitions {offset}: not a layout this reader knows (DeepSpeed "
                f"{layout.get('ds_version')})")

    def _model(self, k: int) -> dict:
        if k not in self._models:
            self._models[k] = _mapped(
                os.path.join(self.folder, f"zero_pp_rank_{k}_mp_rank_00_model_states.pt"))
        return self._models[k]

    def _flat_groups(self, k: int) -> list:
        if k not in self._groups:
            try:
                self._groups[k] = _mapped(
                    self._optim_files[k])["optimizer_state_dict"]["fp32_flat_groups"]
            except (KeyError, TypeError) as err:
                raise CheckpointMismatch(f"{self._optim_files[k]}: no {err} in it: not a ZeRO-3 "
                                         f"optimizer file this reader knows") from None
            bounds = list(itertools.accumulate([0, *(g.numel() for g in self._groups[k])]))
            if self._bounds is None:  # the first rank's file read: every rank's must match
                self._bounds = bounds
            elif bounds != self._bounds:
                raise CheckpointMismatch(f"{self._optim_files[k]}: its fp32 partitions are not "
                                         f"cut as the other ranks' are")
        return self._groups[k]

    def _partition(self, numel: int) -> int:
        return -(-numel // self.ranks)

    def shape(self, name: str) -> torch.Size:
        return self.module[name].shape if self.ranks is None else self.shapes[name]

    def names(self) -> set[str]:
        """The parameters' names (ZeRO-0/1/2: every entry of the module's state dict)."""
        return set(self.module) if self.ranks is None else set(self.shapes)

    def read(self, name: str, start: int = 0, length: int | None = None) -> torch.Tensor:
        """Elements ``start`` to ``start + length`` of the flattened parameter ``name``."""
        if self.ranks is None:
            flat = self.module[name].reshape(-1)
            return flat[start:] if length is None else flat[start:start + length]
        numel = self.shapes[name].numel()
        length = numel - start if length is None else length
        if not 0 <= start <= start + length <= numel:
            raise IndexError(f"{name}: elements {start}..{start + length} of {numel}")
        size, pieces, at = self._partition(numel), [], start
        while at < start + length:
            k, inside = divmod(at, size)  # rank k's partition, from its element `inside`
            take = min(size - inside, start + length - at)
            if name in self._offsets:  # trained: in the rank's fp32 partitions
                piece = self._flat_range(k, self._offsets[name] + inside, take)
            else:  # frozen: its partition in the rank's model file
                frozen = self._model(k).get("frozen_param_fragments") or {}
                if name not in frozen:
                    raise CheckpointMismatch(f"{self.folder}: rank {k}'s model file holds no "
                                             f"partition of the frozen {name}")
                piece = frozen[name].reshape(-1)[inside:inside + take]
            pieces.append(piece)
            at += take
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces) if pieces else torch.empty(0)  # length 0: fp32, empty

    def _flat_range(self, rank: int, start: int, length: int) -> torch.Tensor:
        """Elements of the rank's fp32 partitions, counted over its sub-groups in order (a
        parameter's partition lies within one)."""
        g = bisect.bisect_right(self._bounds, start) - 1
        inside = start - self._bounds[g]
        groups = self._flat_groups(rank)
        if g >= len(groups) or inside + length > groups[g].numel():
            raise CheckpointMismatch(f"{self.folder}: a partition runs past its sub-group's "
                                     f"end in rank {rank}'s file: not a layout this reader knows")
        return groups[g][inside:inside + length]


def load_weights_alone(engine: deepspeed.DeepSpeedEngine, folder: str, zero_stage: int,
                        rank: int) -> None:
    """The weights of the checkpoint ``folder``, of any ZeRO stage and number of ranks
    (:class:`SavedWeights`), into an engine without an optimizer: under ZeRO-3 each rank
    copies the slices of its own partitions alone (of a ZeRO-3 checkpoint of as many ranks:
    from its own files), otherwise each parameter whole; cast to the engine's dtype (as
    ZeRO-3 casts its master copy after a step, or DeepSpeed's bf16 engines theirs)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    saved = SavedWeights(folder, rank)
    module = engine.module
    params = dict(module.named_parameters())
    if saved.ranks is None:  # the whole state dict: its ties and buffers by name too
        want = set(module.state_dict())
    else:
        want = set(params)
    missing, extra = sorted(want - saved.names()), sorted(saved.names() - want)
    if missing or extra:
        frozen = [n for n in missing if n in params and not params[n].requires_grad]
        raise CheckpointMismatch(
            f"{folder} holds the weights of another model: " + (
                f"none of the frozen parameters {frozen[:3]} (saved with DeepSpeed's "
                f"exclude_frozen_parameters?)" if frozen and frozen == missing and not extra else
                f"this model's {missing[:3]} are not there, its {extra[:3]} are not this "
                f"model's"))
    for name, param in params.items():
        shape = param.ds_shape if zero_stage == 3 else param.shape
        if saved.shape(name) != shape:
            raise CheckpointMismatch(f"{folder} holds the weights of another model: {name} "
                                     f"is {tuple(saved.shape(name))} there, {tuple(shape)} here")
    if zero_stage == 3:  # persistent parameters stay gathered after forwards: release them
        engine.empty_partition_cache()
    with torch.no_grad():
        for name, param in params.items():
            if zero_stage != 3:
                param.copy_(saved.read(name).view_as(param))
                continue
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:  # the copy would not reach it
                raise RuntimeError(f"{name} is still gathered (inside a generation context?): "
                                   f"load the weights outside any forward")
            partition = param.ds_tensor.view(-1)
            start = rank * partition.numel()
            take = max(0, min(partition.numel(), param.ds_numel - start))
            if take:  # none where this rank's partition is padding alone
                partition[:take].copy_(saved.read(name, start, take))
        buffers = dict(module.named_buffers())
        for name, tensor in saved.module.items():
            if name in buffers:
                buffers[name].copy_(tensor)
