"""Run megatron-core 0.16.1 on CPU with gloo.

megatron-core assumes a CUDA device: it allocates with `device=torch.cuda.current_device()`
or `device="cuda"`, synchronises streams, seeds the CUDA generator and compares
`tensor.type()` against `"torch.cuda.FloatTensor"`. Nothing else in it depends on CUDA for the
features used here (local layer specs, fp32, no fusions), so a thin layer of patches suffices:

- In the Megatron modules listed in `_CUDA_ASSUMING_MODULES`, the module-level name `torch` is
  rebound to `_CpuTorch`, a view of torch in which `torch.cuda` means "the CPU" (current device
  is the CPU, streams/events/synchronisation are no-ops, the CUDA generator is the CPU one) and
  tensor factories map `device="cuda"` to the CPU. Only code in those modules sees it; torch
  itself and every other caller are untouched.
- A handful of functions get a narrow fix each, listed in `apply_cpu_patches`.
- Expert tensor parallelism (etp > 1) moves tokens between the expert-TP ranks with unevenly sized
  collectives: after the expert-parallel all-to-all each rank holds however many tokens the router
  sent it, and the alltoall dispatcher all-gathers them over the expert-TP group with per-rank
  `output_split_sizes` (and, in backward and in the combine, reduce-scatters with the same
  `input_split_sizes`). NCCL takes lists of tensors of different sizes; gloo refuses them. On gloo
  each rank's piece is padded with zeros to the largest piece, the padded tensor goes through the
  evenly sized collective Megatron uses anyway, and the padding is cut off again
  (`_gather_unevenly`, `_reduce_scatter_unevenly`). The zeros add nothing to a sum and are never
  read, so the result is the uneven collective's.

Apart from CUDA, two start-up costs: as its modules load, megatron-core wraps its fused kernels in
`torch.compile`, whose first wrap imports torch's compiler (inductor, ~1.2 CPU-s), and imports wandb
for its inference engine's logging (~0.35 CPU-s): in every rank process, for features the CPU engine
never uses. `lean_import` loads megatron-core without both.

Everything is keyed to the pinned release; another version raises instead of half-working.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

MEGATRON_CORE_VERSION = "0.16.1"

_CPU = torch.device("cpu")
_FACTORIES = frozenset({"zeros", "ones", "tensor"})  # the ones these modules call with device="cuda"
_applied = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _on_cpu(factory):
    """Wrap a tensor factory so that `device="cuda"` places the tensor on the CPU."""

    def factory_on_cpu(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return factory(*args, **kwargs)

    return factory_on_cpu


class _NoStream:
    """CPU kernels run synchronously, so streams and events have nothing to order or wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return _NoStream()

    def synchronize(self):
        pass


_CPU_STREAM = _NoStream()


class _CpuCuda:
    """`torch.cuda` as seen by patched Megatron modules: the current device is the CPU."""

    Stream = _NoStream

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def current_stream(device=None):
        return _CPU_STREAM

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device=None):
        pass

    # The "CUDA" RNG states Megatron tracks (dropout, init forks) live in the CPU generator.
    get_rng_state = staticmethod(torch.get_rng_state)
    manual_seed = staticmethod(torch.manual_seed)

    def __getattr__(self, name):  # everything else (is_available, amp, ...) is the real torch.cuda
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """`torch` as seen by patched Megatron modules: `torch.cuda` is `_CpuCuda`, factories place on CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return _on_cpu(attr) if name in _FACTORIES else attr


# The modules whose code reaches for the CUDA device on the paths used here (build, forward,
# backward, grad reduction, optimizer step, pipeline p2p) — found by logging every use of the
# view while the equivalence tests ran. Each gets the `_CpuTorch` view.
_CUDA_ASSUMING_MODULES = (
    "megatron.core.utils",  # global memory buffer (attention scores), local grad-norm fallback
    "megatron.core.tensor_parallel.layers",  # sequence-parallel all-gather buffers
    "megatron.core.tensor_parallel.mappings",  # outputs of all-gather / reduce-scatter / all-to-all
    "megatron.core.tensor_parallel.random",  # the "CUDA" RNG tracker seeds and saves generator states
    "megatron.core.transformer.utils",  # default causal mask
    "megatron.core.transformer.moe.router",  # aux-loss buffers
    "megatron.core.transformer.moe.token_dispatcher",  # device-to-host stream for the split sizes
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inverse frequencies
    "megatron.core.pipeline_parallel.schedules",  # token counter
    "megatron.core.pipeline_parallel.p2p_communication",  # receive buffers, synchronize
    "megatron.core.distributed.param_and_grad_buffer",  # contiguous param/grad buffers
    "megatron.core.optimizer.optimizer",  # found-inf / scale tensors
    "megatron.core.optimizer.clip_grads",  # grad-norm buffers
)


def _cpu_type_names(code: types.CodeType) -> types.CodeType:
    """Return `code` with every 'torch.cuda.<X>Tensor' literal (also in tuples, nested code) as 'torch.<X>Tensor'."""

    def fix(const):
        if isinstance(const, str) and const.startswith("torch.cuda.") and const.endswith("Tensor"):
            return "torch." + const[len("torch.cuda.") :]
        if isinstance(const, tuple):
            return tuple(fix(c) for c in const)
        if isinstance(const, types.CodeType):
            return _cpu_type_names(const)
        return const

    return code.replace(co_consts=tuple(fix(c) for c in code.co_consts))


@contextlib.contextmanager
def lean_import():
    """Import megatron-core inside this block: its fused kernels stay plain functions, and it finds no wandb.

    The local layer specs never call the fused kernels; a kernel that did would run eagerly instead
    of compiled, the same arithmetic. megatron-core's own switch (`megatron.core.jit.disable_jit_fuser`)
    lives in the package whose loading wraps the kernels, so it comes too late for them: while the
    block runs, `torch.compile` hands back the function it is given, and afterwards the switch covers
    the megatron modules that load later. wandb is hidden only while the block runs (megatron-core
    then logs nothing to it); this process can import it afterwards as usual.
    """
    compile_ = torch.compile
    torch.compile = _leave_uncompiled
    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError, which megatron-core expects
    try:
        yield
    finally:
        torch.compile = compile_
        if hide_wandb:
            del sys.modules["wandb"]
    from megatron.core import jit

    jit.disable_jit_fuser()


def _leave_uncompiled(model=None, **options):
    """`torch.compile`'s signature, as a decorator with or without options, compiling nothing."""
    return model if model is not None else (lambda fn: fn)


def _check_version():
    import megatron.core

    version = getattr(megatron.core, "__version__", None)
    if version != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"ftexp's CPU compatibility layer is written for megatron-core=={MEGATRON_CORE_VERSION}, "
            f"found {version!r}; install the pinned version"
        )


def apply_cpu_patches() -> None:
    """Patch megatron-core for CPU + gloo; idempotent. Call before building models."""
    global _applied
    if _applied:
        return
    _check_version()

    cpu_torch = _CpuTorch()
    for name in _CUDA_ASSUMING_MODULES:
        importlib.import_module(name).torch = cpu_torch

    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # The RNG tracker saves/restores "CUDA" states through these helpers: use the CPU generator.
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    # Grad clipping asserts grads are 'torch.cuda.FloatTensor': accept the CPU float type.
    _retarget(clip_grads.clip_grad_by_total_norm_fp32)
    # The distributed optimizer sorts params by their CUDA type names: accept the CPU ones.
    _retarget(distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups)

    # Without Apex the torch norm wrapper refuses sequence parallelism; the norm itself is
    # per-token, so only its grads need care: mark them for the TP all-reduce of SP norms.
    torch_norm.WrappedTorchNorm.__new__ = _norm_allowing_sequence_parallel(torch_norm.WrappedTorchNorm.__new__)

    # megatron-core 0.16.1 reads `te_general_gemm` in the router even when Transformer Engine
    # failed to import and the name was never bound (NameError): bind it to "absent".
    moe_utils.te_general_gemm = None

    # The alltoall dispatcher moves split sizes to host memory only when they are on CUDA; on
    # CPU they stay tensors, which all_to_all_single rejects. Convert CPU tensors the same way.
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy_for_cpu_tensors(moe_utils.maybe_move_tensor_to_cpu)

    # Expert-TP's unevenly sized all-gather / reduce-scatter: padded to even sizes for gloo.
    mappings._gather_along_first_dim = _gather_unevenly(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_unevenly(mappings._reduce_scatter_along_first_dim)

    # The CP slice of the rotary embedding builds its chunk index with `.cuda()`: index on CPU.
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank

    # Tied embeddings: the first and last pipeline stages' copies are made equal by an all-reduce of
    # `weight.data.cuda()` (a tensor method, out of the module view's reach): all-reduce it where it is.
    language_module.LanguageModule.setup_embeddings_and_output_layer = _tensors_stay_on_cpu(
        language_module.LanguageModule.setup_embeddings_and_output_layer)

    _applied = True


def _retarget(func) -> None:
    func = getattr(func, "__func__", func)  # classmethods: patch the underlying function
    func.__code__ = _cpu_type_names(func.__code__)


def _norm_allowing_sequence_parallel(original_new):
    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        config_without_sp = _shallow_copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(cls, config_without_sp, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


def _shallow_copy(obj):
    clone = object.__new__(type(obj))
    clone.__dict__.update(obj.__dict__)
    return clone


def _host_copy_for_cpu_tensors(move_to_cpu):
    def move_or_convert(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move_or_convert


def _tensors_stay_on_cpu(method):
    """`method` with `Tensor.cuda` returning the tensor itself while it runs."""
    def on_cpu(self, *args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *_, **__: tensor
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    return on_cpu


def _padded_to(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended along the first dimension up to `rows`."""
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])


def _gather_unevenly(gather_evenly):
    """mappings._gather_along_first_dim whose `output_split_sizes` (rank r sends that many rows) work on gloo."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather_evenly(input_, group, None, use_global_buffer)
        rows = max(output_split_sizes)
        gathered = gather_evenly(_padded_to(input_.contiguous(), rows), group, None, False)
        pieces = gathered.split(rows)
        return torch.cat([piece[:size] for piece, size in zip(pieces, output_split_sizes)])

    return gather


def _reduce_scatter_unevenly(reduce_scatter_evenly):
    """mappings._reduce_scatter_along_first_dim whose `input_split_sizes` (rank r keeps that many rows) work on gloo."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter_evenly(input_, group, None, use_global_buffer)
        rows = max(input_split_sizes)
        padded = torch.cat([_padded_to(piece, rows) for piece in input_.split(input_split_sizes)])
        return reduce_scatter_evenly(padded, group, None, False)[: input_split_sizes[group.rank()]]

    return reduce_scatter


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """rope_utils.get_pos_emb_on_this_cp_rank with the chunk index on the embedding's device."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunk_ids = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, chunk_ids)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])
