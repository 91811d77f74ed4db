"""Classifier-free guidance across processes: one call on two ranks, each running one branch
of the guidance (`model.parallel.cfg: 2`).

Every rank holds the same pipeline and runs the same call with the same inputs and seeds (the
replica sends each call to its workers; no Ray here: only `torch.distributed`). Pipelines guide
in one of two ways, and both are split:

- **one batched call a step** (SD, SDXL, SD3): the unconditional and conditional rows are stacked,
  2B rows for B images; each rank runs its half of every batched argument, the halves' outputs
  are gathered, and every rank goes on with the whole output;
- **two calls a step on the same latents** (FLUX's true CFG, Wan, Qwen-Image): the first step runs
  both calls on every rank while the pattern is learned; from the second on, rank 0 runs the first
  call and rank 1 the second, and at the second they swap outputs (rank 1 returned a buffer for the
  first call, filled in place then, before the pipeline combines the two).

A call of neither shape (no guidance) runs whole on every rank: the same answer, no gain. At the
end of every step rank 0 says whether the call goes on (`agree`), so an abort seen by the replica
stops every rank at the same step.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch

from serve_app.engine.types import InvalidArguments, StepHook

# Denoiser arguments whose first dimension is not the batch even when its length matches
# (token positions of FLUX-style transformers, rotary tables).
_UNBATCHED = frozenset({"img_ids", "txt_ids", "image_rotary_emb", "img_shapes", "txt_seq_lens"})


@dataclass
class Group:
    """This process's place among the ranks of one replica, and what it knows of the call now
    running (reset by `begin`)."""

    rank: int
    world: int
    device: torch.device
    cfg: int = 1  # ranks the guidance's branches are shared over (1 or 2)
    sequence: int = 1  # ranks the tokens are shared over (ulysses * ring)
    branch: int = 0  # this rank's branch of the guidance (its place along `cfg`)
    tokens: int | None = None  # tokens this rank's output projection last saw (its share, with ulysses)
    cfg_group: Any = None  # the ranks of this one's token share, one a branch (None: all ranks)
    rows: int | None = None  # images of the call now running, for the batched rule
    split_calls: int = 0  # denoiser calls run split so far (a count for tests and status)
    paired: bool | None = None  # the call runs two denoiser calls a step (None: not known yet)
    step: list = field(default_factory=list)  # this step's calls: (latents, output, its sample)
    first: Any = None  # a paired step's first output: rank 0's own, or rank 1's buffer for it
    template: torch.Tensor | None = None  # a paired call's output sample (shape, dtype, device)
    kind: type | None = None  # and the type of its output (a tuple, a diffusers output class)

    def begin(self, rows: int) -> None:
        self.rows, self.paired, self.step, self.first = rows, None, [], None

    def step_done(self) -> None:
        """After the first step, decide whether the call's steps are two calls on the same
        latents whose outputs have one shape (the two branches of guidance)."""
        if self.paired is None:
            s = self.step
            self.paired = (
                self.cfg == 2 and len(s) == 2 and s[0][0] is s[1][0] and s[0][2].shape == s[1][2].shape
            )
            if self.paired:
                self.template, self.kind = s[0][2], type(s[0][1])
        self.step, self.first = [], None


def init_group(
    rank: int, world: int, address: str, port: int, timeout_s: float, device: torch.device
) -> Group:
    """Join the replica's process group (every rank calls this; it returns once all have): NCCL
    for CUDA engines, gloo for CPU ones."""
    import torch.distributed as dist

    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return Group(rank, world, device)


def share(denoiser: torch.nn.Module, group: Group, cfg: int, ulysses: int, ring: int) -> None:
    """Share the denoiser's calls among the ranks of `group`: the guidance's branches over `cfg`
    ranks (with `cfg` alone rank k runs branch k), the tokens over `ulysses * ring`; ValueError
    naming the field where this denoiser cannot."""
    group.cfg, group.branch = cfg, group.rank if cfg > 1 else 0
    if ulysses * ring > 1:
        share_sequence(denoiser, group, ulysses, ring)
    split_denoiser(denoiser, group)


def share_sequence(denoiser: torch.nn.Module, group: Group, ulysses: int, ring: int) -> None:
    """Spread the denoiser's tokens over the ranks with diffusers' context parallelism (Ulysses
    all-to-all, ring attention), within each branch of the guidance where `cfg` shares those;
    ValueError naming the field where this denoiser cannot."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    field = "model.parallel.ulysses" if ulysses > 1 else "model.parallel.ring"
    if getattr(denoiser, "_cp_plan", None) is None:
        raise ValueError(
            f"{field}: {type(denoiser).__name__} has no context-parallel plan in diffusers (the FLUX, "
            "FLUX.2, Wan, Qwen-Image and LTX transformers have one; a UNet or SD3 has none)"
        )
    heads = getattr(denoiser.config, "num_attention_heads", None)
    if ulysses > 1 and heads and heads % ulysses:
        raise ValueError(f"model.parallel.ulysses: {ulysses} does not divide the {heads} attention heads")
    mesh = None
    if group.cfg > 1:  # ranks (b, r, u): branch b; those of one branch share its tokens
        mesh = init_device_mesh(
            group.device.type, (group.cfg, ring, ulysses), mesh_dim_names=("cfg", "ring", "ulysses")
        )
        group.cfg_group, group.branch = mesh.get_group("cfg"), mesh.get_local_rank("cfg")
    config = ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring, mesh=mesh)
    if group.device.type == "cpu":  # diffusers picks `rank % accelerator count`: 0 on a CPU build
        from unittest import mock

        with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
            denoiser.enable_parallelism(config=config)
    else:
        denoiser.enable_parallelism(config=config)
    group.sequence = ulysses * ring
    out = getattr(denoiser, "proj_out", None)  # where the plans gather the tokens (after: whole)
    if isinstance(out, torch.nn.Module):
        out.register_forward_pre_hook(lambda _, args: setattr(group, "tokens", args[0].shape[1]))


def agree(group: Group | None, stop: bool) -> bool:
    """Rank 0's `stop`, on every rank (one small broadcast a step)."""
    if group is None or group.world == 1:
        return stop
    import torch.distributed as dist

    flag = torch.tensor([1 if stop else 0], dtype=torch.int32, device=group.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def agreeing(group: Group, hook: StepHook | None) -> StepHook:
    """A step hook for every rank: rank 0's `hook` decides, the others hear it (they have none)."""

    def agreed(step: int, total: int, preview) -> bool:
        try:
            stop = bool(hook(step, total, preview)) if hook is not None else False
        except BaseException:  # the others stop too, then rank 0 raises
            agree(group, True)
            raise
        group.step_done()
        return agree(group, stop)

    return agreed


def split_denoiser(denoiser: torch.nn.Module, group: Group) -> None:
    """Make `denoiser` run this rank's share of each guided step and return what one process
    would: its `forward` is wrapped (hooks on it still see every call whole)."""
    inner = denoiser.forward

    def run(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except AssertionError as e:  # torch's sharding of a length the ranks do not divide
            if group.sequence == 1 or "divisible" not in str(e):
                raise
            raise InvalidArguments(
                f"size: this size (and frame count) makes a number of tokens the model's "
                f"{group.sequence} ranks (model.parallel) cannot share evenly; choose another",
                param="size",
            ) from None

    def forward(*args, **kwargs):
        sample = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
        n = sample.shape[0]
        if group.cfg == 1:  # the tokens are shared (`share_sequence`): every call is
            group.split_calls += 1
            return run(*args, **kwargs)
        if group.rows is not None and n == 2 * group.rows:
            part, lo = n // 2, group.branch * (n // 2)
            args = tuple(_half(a, n, lo, part) for a in args)
            kwargs = {k: v if k in _UNBATCHED else _half(v, n, lo, part) for k, v in kwargs.items()}
            group.split_calls += 1
            return _gathered(run(*args, **kwargs), group)
        if group.paired:
            return _paired(group, len(group.step), lambda: run(*args, **kwargs))
        out = run(*args, **kwargs)
        group.step.append((sample, out, _sample(out)))
        return out

    denoiser.forward = forward


def _paired(group: Group, index: int, run) -> Any:
    """Call `index` of a paired step: rank 0 runs the first, rank 1 the second; at the second
    they swap their outputs."""
    import torch.distributed as dist

    group.step.append(None)
    if index == 0:
        if group.branch == 0:
            group.first = run()
            return group.first
        group.first = torch.empty_like(group.template)
        return _as_output(group.kind, group.first)
    if index > 1:  # a third call in a step: not the pattern learned; every rank runs it
        return run()
    mine = run() if group.branch == 1 else None
    parts = [torch.empty_like(group.template) for _ in range(2)]
    dist.all_gather(
        parts, _sample(mine if mine is not None else group.first).contiguous(), group=group.cfg_group
    )
    group.split_calls += 1
    if group.branch == 1:
        group.first.copy_(parts[0])  # the pipeline holds it as the first call's output
        return mine
    return _as_output(group.kind, parts[1])


def _half(value: Any, n: int, lo: int, part: int) -> Any:
    """`value` with this rank's rows of its batch dimension (tensors of `n` rows, in dicts too)."""
    if torch.is_tensor(value):
        return value[lo : lo + part] if value.dim() and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _half(v, n, lo, part) for k, v in value.items()}
    return value


def _sample(out: Any) -> torch.Tensor:
    """The denoiser output's sample: the first of a tuple, `.sample` of a diffusers output."""
    if isinstance(out, tuple | list):
        return out[0]
    return out.sample if hasattr(out, "sample") else out


def _as_output(kind: type, sample: torch.Tensor) -> Any:
    """`sample` in the form the denoiser returns (`kind`, the type of its output)."""
    if issubclass(kind, tuple | list):
        return (sample,)
    return sample if issubclass(kind, torch.Tensor) else kind(sample=sample)


def _gathered(out: Any, group: Group) -> Any:
    """The denoiser's output with its sample gathered from every rank, in rank order: the whole
    batch, as one process would have made it."""
    import torch.distributed as dist

    sample = _sample(out)
    parts = [torch.empty_like(sample) for _ in range(group.cfg)]
    dist.all_gather(parts, sample.contiguous(), group=group.cfg_group)
    whole = torch.cat(parts)
    if isinstance(out, tuple):
        return (whole, *out[1:])
    return whole if torch.is_tensor(out) else _as_output(type(out), whole)
