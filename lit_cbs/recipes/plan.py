"""What a training run will need, worked out before it starts: steps per batch phase, memory per
device, the CBS probe's host memory and tokens, and the wall time at a given MFU.

Pure arithmetic on the model's shape (the decoder is built on the meta device: no weights, no
data, no accelerator). Memory is counted the way the training code allocates it:

- **Model state** per device: parameters and gradients in the parameter dtype (fp32 for
  ``32-true`` and ``*-mixed``, bf16/fp16 for ``*-true``) and the optimizer's state: AdamW's two
  moments in that dtype plus one fp32 ``step`` scalar per parameter tensor. Another optimizer's
  state is measured by one step of it on a small parameter (``OptimizerState.measure``): state tensors
  the size of the parameter count per parameter element, in the parameter's dtype (as torch's
  optimizers keep them), any other state (a step count) per parameter tensor. Factored or
  low-precision state (Adafactor's row and column statistics, 8-bit moments) is not modelled
  exactly. Under FSDP2 (``ModelParallelStrategy``) all of it is sharded over the data-parallel ranks.
- **Working buffers**: under FSDP2 the gathered (unsharded) parameters of the root module
  (embedding and output head) and of up to three blocks (the one computing, the one prefetched,
  and the last, which CausalLM keeps gathered between forward and backward), plus one block's
  unsharded gradient and its fp32 reduce-scatter buffer; under DDP its gradient buckets (a copy of
  the gradients); under ``*-mixed`` autocast without FSDP2, the low-precision copies of the
  matmul weights that autocast keeps for the step (with activation checkpointing, of the blocks
  only the one being recomputed).
- **Activations**: the tensors autograd saves for backward, counted per block for lit_cbs's OLMo
  block (flash-style attention: queries, keys, values, output and a log-sum-exp per head and
  position, no T x T matrix), plus the loss's log-softmax over the vocabulary. A transformers
  model's layers are counted as that block at the model's sizes (Llama-style: attention, then a
  gated MLP of ``intermediate_size``); parameters are counted exactly from its meta-device build,
  its activations only as closely as its layers resemble that block (grouped-query attention's
  smaller keys and values are counted full size). With activation
  checkpointing a block saves only its fp32 input, and backward recomputes one block at a time,
  so the peak adds one block's activations. The peak also adds the logits (the low-precision
  matmul output and its fp32 copy) that live while the loss is computed.

The CUDA context, NCCL buffers and allocator fragmentation come on top (a few GiB in practice),
hence the headroom the plan asks for. Memory figures are in bytes; ``GIB`` converts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from lit_cbs.models.build import build_decoder
from lit_cbs.models.decoder import DecoderDims, decoder_dims, embedding_parameters
from lit_cbs.models.hf import HFDecoder
from lit_cbs.models.olmo import OLMo, OLMoConfig
from lit_cbs.rules.batch_schedules import BatchSchedule, micro_batch_for

__all__: list[str] = []  # users run it as `plan=true`; recipes/train.py calls plan_run

GIB = 2**30
STRATEGIES = ("single", "ddp", "fsdp")
TOKEN_BYTES = 8  # TokenDataModule batches are int64 token ids
# precision -> (bytes per parameter element, bytes per activation element of the matmuls)
PRECISIONS = {
    "32-true": (4, 4),
    "32": (4, 4),
    "bf16-mixed": (4, 2),
    "16-mixed": (4, 2),
    "bf16-true": (2, 2),
    "16-true": (2, 2),
}


def precision_bytes(precision: str) -> tuple[int, int]:
    """(parameter bytes, activation bytes) per element at a Lightning ``precision``.

    Args:
        precision: the Trainer's ``precision`` (``PRECISIONS``: ``32-true``, ``bf16-mixed``, ...).

    Returns:
        Bytes per parameter element and bytes per activation element of the matmuls.

    Raises:
        ValueError: a precision the plan does not know.

    Examples:
        >>> precision_bytes("bf16-mixed"), precision_bytes("bf16-true")
        ((4, 2), (2, 2))
        >>> precision_bytes("fp8")
        Traceback (most recent call last):
        ...
        ValueError: precision='fp8' is not one the plan knows; use one of ['32-true', ...]
    """
    if str(precision) not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one the plan knows; use one of {list(PRECISIONS)}")
    return PRECISIONS[str(precision)]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Parameter counts (elements) of a decoder, read from a meta-device build (lit_cbs's OLMo or a
    transformers model: ``lit_cbs.models.build.build_decoder``).

    Examples:
        >>> from lit_cbs.models import get_config
        >>> shape = ModelShape.measure(get_config("tiny"))
        >>> shape.parameters, shape.block_parameters, shape.root_parameters  # root: embedding and untied head
        (233472, 50176, 32768)
        >>> shape.flops_per_token(128)
        1695744
    """

    config: DecoderDims
    parameters: int  # all of them
    parameter_tensors: int
    block_parameters: int  # one block's
    root_parameters: int  # outside the blocks: embedding and untied output head
    autocast_weights: int  # matmul weights autocast casts each step: all but the embedding (tied: it is also the head)
    model: OLMo | HFDecoder = dataclasses.field(repr=False, compare=False)  # on the meta device

    @classmethod
    def measure(cls, config: OLMoConfig | object) -> ModelShape:
        """The shape of the decoder ``config`` describes (an ``OLMoConfig`` or a transformers config).

        Args:
            config: an ``OLMoConfig`` or a ``transformers`` config; the decoder is built on the meta device.

        Returns:
            Its parameter counts (elements), and the meta-device decoder.
        """
        with torch.device("meta"):
            model = build_decoder(config)
        dims = decoder_dims(config)
        block = sum(p.numel() for p in model.blocks[0].parameters())
        embeddings = sum(p.numel() for p in embedding_parameters(model))
        total = model.num_parameters()
        return cls(
            config=dims,
            parameters=total,
            parameter_tensors=len(list(model.parameters())),
            block_parameters=block,
            root_parameters=total - dims.n_layers * block,
            autocast_weights=total - (0 if dims.tie_embeddings else embeddings),
            model=model,
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (the decoder's ``flops_per_token``: 6N + attention).

        Args:
            seq_len: tokens per sequence.

        Returns:
            FLOPs of the forward and backward passes per token.
        """
        return self.model.flops_per_token(seq_len)


@dataclasses.dataclass(frozen=True)
class OptimizerState:
    """What an optimizer keeps per parameter tensor: ``per_element`` state tensors the size of the
    parameter (in its dtype), and ``bytes_per_tensor`` bytes besides (e.g. a step count).

    Examples:
        >>> import torch
        >>> OptimizerState.measure(torch.optim.AdamW)  # two moments, and a 4-byte step count
        OptimizerState(name='AdamW', per_element=2, bytes_per_tensor=4)
        >>> OptimizerState.measure(torch.optim.SGD)
        OptimizerState(name='SGD', per_element=0, bytes_per_tensor=0)
    """

    name: str
    per_element: int
    bytes_per_tensor: int

    @classmethod
    def measure(cls, optimizer: Callable[[list], torch.optim.Optimizer]) -> OptimizerState:
        """Measured: ``optimizer`` (parameters -> Optimizer, e.g. ``torch.optim.AdamW`` or a partial
        of it) takes one step on a 4 x 8 fp32 parameter, and its state is counted.

        Args:
            optimizer: parameters -> ``torch.optim.Optimizer``.

        Returns:
            The optimizer's class name and what it keeps per parameter tensor.
        """
        parameter = torch.nn.Parameter(torch.zeros(4, 8))
        parameter.grad = torch.ones_like(parameter)
        built = optimizer([parameter])
        built.step()
        state = [value for value in built.state[parameter].values() if isinstance(value, torch.Tensor)]
        like_parameter = [value for value in state if value.numel() == parameter.numel()]
        return cls(
            name=type(built).__name__,
            per_element=sum(value.element_size() for value in like_parameter) // parameter.element_size(),
            bytes_per_tensor=sum(value.nbytes for value in state if value.numel() != parameter.numel()),
        )


ADAMW_STATE = OptimizerState("AdamW", per_element=2, bytes_per_tensor=4)  # exp_avg, exp_avg_sq; an fp32 step


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device (GPU, or the process's memory on CPU) at the peak of a training step.

    Examples:
        >>> memory = DeviceMemory(parameters=4, gradients=4, optimizer_state=8, working_buffers=1, activations=10,
        ...                       activation_peak_extra=2)
        >>> memory.model_state, memory.total
        (16, 29)
    """

    parameters: int
    gradients: int
    optimizer_state: int
    working_buffers: int
    activations: int  # saved for backward, at the end of the forward pass
    activation_peak_extra: int  # the recomputed block (activation checkpointing) and the logits at the loss

    @property
    def model_state(self) -> int:
        """Bytes of the parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        """Bytes at the step's peak: the model state, working buffers, saved activations and the peak's extra."""
        return self.model_state + self.working_buffers + self.activations + self.activation_peak_extra


def block_activation_bytes(config: DecoderDims, micro_batch: int, seq_len: int, precision: str) -> int:
    """Bytes one block saves for backward for a micro-batch of ``micro_batch`` x ``seq_len`` tokens.

    fp32 throughout: the block input and the residual after attention (the two LayerNorm inputs),
    the two LayerNorm outputs (each the input of its matmuls), q and k after RoPE, v, the attention
    output, gate, up, silu(gate) and their product (d_model or mlp_hidden wide), the LayerNorms'
    mean and rstd and attention's log-sum-exp per head. Under autocast the residual stream, the
    LayerNorm statistics and the log-sum-exp stay fp32, everything else is low precision, and
    each matmul saves its own cast of its LayerNorm's output (three for q, k, v; two for gate, up).

    Args:
        config: the decoder's dimensions (``ModelShape.config``).
        micro_batch: samples per forward pass on one device.
        seq_len: tokens per sample.
        precision: the Trainer's ``precision``.

    Returns:
        Bytes one block saves for backward.

    Raises:
        ValueError: a precision the plan does not know.

    Examples:
        >>> from lit_cbs.models.decoder import decoder_dims
        >>> from lit_cbs.models import get_config
        >>> dims = decoder_dims(get_config("tiny"))
        >>> block_activation_bytes(dims, 8, 128, "32-true"), block_activation_bytes(dims, 8, 128, "bf16-mixed")
        (5013504, 3178496)
    """
    _, act = precision_bytes(precision)
    tokens = micro_batch * seq_len
    d, f, heads = config.d_model, config.mlp_hidden, config.n_heads
    small = 4 * (4 * tokens + heads * tokens)  # two LayerNorms' mean and rstd, attention's log-sum-exp
    if act == 4:
        return 4 * tokens * (8 * d + 4 * f) + small
    residual = 4 * tokens * 2 * d
    return residual + act * tokens * (9 * d + 4 * f) + small


def loss_activation_bytes(config: DecoderDims, micro_batch: int, seq_len: int, precision: str) -> int:
    """Bytes saved outside the blocks: input ids (with the target column), RoPE's cos and sin, the
    final LayerNorm's input, statistics and output, the targets and the fp32 log-softmax.

    Args:
        config: the decoder's dimensions (``ModelShape.config``).
        micro_batch: samples per forward pass on one device.
        seq_len: tokens per sample.
        precision: the Trainer's ``precision``.

    Returns:
        Bytes saved for backward outside the blocks.

    Raises:
        ValueError: a precision the plan does not know.

    Examples:
        >>> from lit_cbs.models.decoder import decoder_dims
        >>> from lit_cbs.models import get_config
        >>> loss_activation_bytes(decoder_dims(get_config("tiny")), 8, 128, "32-true")  # mostly 4 x 1,024 x 256
        1613892
    """
    _, act = precision_bytes(precision)
    tokens = micro_batch * seq_len
    d, vocab = config.d_model, config.vocab_size
    ids = TOKEN_BYTES * micro_batch * (seq_len + 1) + TOKEN_BYTES * tokens
    rope = 2 * 4 * seq_len * config.head_dim
    final_norm = 4 * tokens * d + 4 * 2 * tokens + act * tokens * d
    return ids + rope + final_norm + 4 * tokens * vocab + 4  # + the loss scalar


def device_memory(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    precision: str,
    strategy: str,
    data_parallel_size: int,
    activation_checkpointing: bool,
    optimizer: OptimizerState = ADAMW_STATE,
) -> DeviceMemory:
    """Peak bytes per device for one training step (see the module docstring for what is counted).

    Args:
        shape: the model's parameter counts (``ModelShape.measure``).
        micro_batch: samples per forward pass on one device.
        seq_len: tokens per sample.
        precision: the Trainer's ``precision``.
        strategy: ``single``, ``ddp`` or ``fsdp`` (FSDP2 shards the model state over ``data_parallel_size``).
        data_parallel_size: data-parallel ranks.
        activation_checkpointing: whether each block recomputes its activations in backward.
        optimizer: what the optimizer keeps per parameter (default AdamW's).

    Returns:
        The bytes per device, by kind.

    Raises:
        ValueError: an unknown ``strategy`` or ``precision``, or ``data_parallel_size`` below 1.

    Examples:
        >>> from lit_cbs.models import get_config
        >>> shape = ModelShape.measure(get_config("tiny"))
        >>> memory = device_memory(shape, 8, 128, "32-true", "single", 1, activation_checkpointing=False)
        >>> memory.parameters, memory.optimizer_state  # 233,472 x 4 bytes; two moments and 30 step counts
        (933888, 1867896)
        >>> round(memory.total / GIB, 4)
        0.0256
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")
    param_bytes, act = precision_bytes(precision)
    config = shape.config
    shards = data_parallel_size if strategy == "fsdp" else 1
    local = math.ceil(shape.parameters / shards)
    parameters = local * param_bytes
    optimizer_state = optimizer.per_element * local * param_bytes + optimizer.bytes_per_tensor * shape.parameter_tensors

    if strategy == "fsdp":
        gathered = (shape.root_parameters + min(3, config.n_layers) * shape.block_parameters) * act
        # One rank gathers nothing, but still casts to the low-precision parameter dtype.
        working = gathered + shape.block_parameters * (act + 4) if shards > 1 or act < param_bytes else 0
    else:
        working = parameters if strategy == "ddp" else 0  # DDP's gradient buckets
        if act < param_bytes:  # autocast's copies; with checkpointing, of one block's weights at a time
            recomputed = (config.n_layers - 1) * shape.block_parameters if activation_checkpointing else 0
            working += (shape.autocast_weights - recomputed) * act

    block = block_activation_bytes(config, micro_batch, seq_len, precision)
    outside = loss_activation_bytes(config, micro_batch, seq_len, precision)
    logits = micro_batch * seq_len * config.vocab_size * (act + 4)
    if activation_checkpointing:
        saved = config.n_layers * 4 * micro_batch * seq_len * config.d_model + outside
        extra = block + logits
    else:
        saved = config.n_layers * block + outside
        extra = logits
    return DeviceMemory(parameters, parameters, optimizer_state, working, saved, extra)


# ---------------------------------------------------------------------- the batch schedule
@dataclasses.dataclass(frozen=True)
class BatchPhase:
    """A stretch of training at one global batch. Tokens and samples are global.

    Examples:
        >>> phase = BatchPhase(start_tokens=0, end_tokens=65536, global_batch=8, micro_batch=4, accumulate=2,
        ...                    optimizer_steps=64, lr_factor=1.0)
        >>> phase.tokens
        65536
    """

    start_tokens: int
    end_tokens: int
    global_batch: int  # samples
    micro_batch: int  # samples per rank per forward
    accumulate: int  # micro-batches per optimizer step
    optimizer_steps: int
    lr_factor: float  # product of the batch changes' LR factors so far

    @property
    def tokens(self) -> int:
        """Tokens trained in the phase."""
        return self.end_tokens - self.start_tokens


def batch_phases(
    schedule: BatchSchedule,
    max_tokens: int,
    seq_len: int,
    micro_batch: int | Callable[[int], int],
    data_parallel_size: int,
    lr_factor: Callable[[float], float],
) -> list[BatchPhase]:
    """The run's phases, step by step as BatchWarmup takes them: each optimizer step trains on the
    batch the schedule gives for what was consumed before it, a change waits for the samples
    consumed to be a multiple of the new batch (as BatchWarmup does within an epoch; the plan
    assumes one epoch), and the run stops after the step that reaches ``max_tokens``.
    ``micro_batch``: samples per rank, or global batch -> micro-batch (BatchWarmup's
    ``max_micro_batch_size`` rule, ``lit_cbs.rules.batch_schedules.micro_batch_for``).

    Args:
        schedule: the batch schedule (global batches in samples).
        max_tokens: the run's token budget (global).
        seq_len: tokens per sample.
        micro_batch: samples per rank per forward, or global batch -> that.
        data_parallel_size: data-parallel ranks.
        lr_factor: batch ratio new / old -> LR factor (the LR rule's ``factor``).

    Returns:
        The phases in order.

    Examples:
        The batch doubles at 65,536 tokens under the sqrt LR rule; the last step passes max_tokens:

        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> schedule = PiecewiseBatch(thresholds=[0, 65536], batch_sizes=[8, 16], unit="tokens")
        >>> phases = batch_phases(schedule, 200_000, 128, 8, 1, lambda ratio: ratio**0.5)
        >>> [(p.start_tokens, p.end_tokens, p.global_batch, p.accumulate, p.optimizer_steps) for p in phases]
        [(0, 65536, 8, 1, 64), (65536, 200704, 16, 2, 66)]
        >>> round(phases[1].lr_factor, 4)
        1.4142
    """
    micro_for = micro_batch if callable(micro_batch) else (lambda global_batch: micro_batch)
    phases: list[BatchPhase] = []
    tokens = samples = steps = 0
    batch, factor, start = None, 1.0, 0
    while tokens < max_tokens:
        new = schedule.batch_size(tokens if schedule.unit == "tokens" else samples)
        if new != batch and (batch is None or samples % new == 0):
            if batch is not None:
                phases.append(_phase(start, tokens, batch, micro_for(batch), data_parallel_size, steps, factor))
                factor *= lr_factor(new / batch)
            batch, start, steps = new, tokens, 0
        tokens += batch * seq_len
        samples += batch
        steps += 1
    if batch is not None:
        phases.append(_phase(start, tokens, batch, micro_for(batch), data_parallel_size, steps, factor))
    return phases


def _phase(start, end, batch, micro_batch, data_parallel_size, steps, factor) -> BatchPhase:
    return BatchPhase(start, end, batch, micro_batch, batch // (micro_batch * data_parallel_size), steps, factor)


def largest_micro_batch(limit_bytes: float, largest_share: int, memory_at: Callable[[int], DeviceMemory]) -> int | None:
    """The largest micro-batch (samples per rank, at most ``largest_share``) whose step fits
    ``limit_bytes`` by ``memory_at(micro) -> DeviceMemory``; None if one sample does not fit.

    Args:
        limit_bytes: the memory one device may use (bytes).
        largest_share: the largest micro-batch worth trying (samples: the largest global batch per rank).
        memory_at: micro-batch -> the step's ``DeviceMemory``.

    Returns:
        The micro-batch (samples), or None.

    Examples:
        >>> def memory_at(micro):  # 10 bytes of model state, 3 bytes of activations per sample
        ...     return DeviceMemory(10, 0, 0, 0, 3 * micro, 0)
        >>> largest_micro_batch(32, 64, memory_at), largest_micro_batch(12, 64, memory_at)
        (7, None)
    """
    fits = None
    for micro in range(1, largest_share + 1):
        if memory_at(micro).total > limit_bytes:
            break  # memory grows with the micro-batch
        fits = micro
    return fits


# ---------------------------------------------------------------------- growing the cluster with the batch
@dataclasses.dataclass(frozen=True)
class ClusterPhase:
    """One batch phase trained on its own number of ranks (whole nodes): ``grow_cluster``'s."""

    phase: BatchPhase
    ranks: int
    micro_batch: int  # samples per rank
    accumulate: int
    end_step: int  # optimizer steps taken when the phase ends (where the run stops to move)


def grow_cluster(
    phases: list[BatchPhase],
    ranks: int,
    devices_per_node: int,
    min_micro_batch_size: int,
    max_devices: int | None,
    micro_batch_for: Callable[[int, int], int],
) -> list[ClusterPhase]:
    """Per phase, the fewest ranks (whole nodes of ``devices_per_node``) at which a rank's work per step
    is no more than in the first phase (its share of the batch, batch / ranks, no larger), as long as
    each rank's micro-batch stays at or above ``min_micro_batch_size`` and the ranks at most
    ``max_devices``. The first phase keeps the run's ``ranks``. ``micro_batch_for(global batch, ranks)``.

    Args:
        phases: the run's batch phases (``batch_phases``).
        ranks: the run's ranks, kept for the first phase.
        devices_per_node: ranks per node; a phase trains on whole nodes.
        min_micro_batch_size: no rank's micro-batch below this (samples).
        max_devices: at most this many ranks, or None.
        micro_batch_for: (global batch, ranks) -> micro-batch per rank (samples).

    Returns:
        Per phase, its ranks, micro-batch, accumulation and the optimizer steps taken when it ends.

    Examples:
        Once the batch doubles, two single-device nodes keep each rank's share at 8 samples:

        >>> phases = [BatchPhase(0, 65536, 8, 8, 1, 64, 1.0), BatchPhase(65536, 200704, 16, 8, 2, 66, 1.4142)]
        >>> grown = grow_cluster(phases, 1, 1, 1, None, lambda batch, ranks: batch // ranks)
        >>> [(c.ranks, c.micro_batch, c.accumulate, c.end_step) for c in grown]
        [(1, 8, 1, 64), (2, 8, 1, 130)]
    """
    first_share = phases[0].global_batch / ranks
    planned: list[ClusterPhase] = []
    end_step = 0
    for phase in phases:
        batch = phase.global_batch
        candidates = [w for w in range(devices_per_node, batch + 1, devices_per_node) if batch % w == 0]
        if max_devices is not None:
            candidates = [w for w in candidates if w <= max_devices] or candidates[:1]
        efficient = [w for w in candidates if micro_batch_for(batch, w) >= min_micro_batch_size] or candidates[:1]
        enough = [w for w in efficient if batch / w <= first_share]
        chosen = ranks if not planned else (enough[0] if enough else efficient[-1])
        micro = micro_batch_for(batch, chosen)
        end_step += phase.optimizer_steps
        planned.append(ClusterPhase(phase, chosen, micro, batch // (micro * chosen), end_step))
    return planned


# ---------------------------------------------------------------------- the CBS probe
@dataclasses.dataclass(frozen=True)
class ProbePlan:
    """What a CBSProbeCallback will cost. Bytes are per rank, in host memory (snapshot_device=cpu).

    Examples:
        >>> plan = ProbePlan(points=[65536, 131072], snapshot_bytes=100, window_bytes=30, heldout_bytes=20,
        ...                  max_branches=4, window_tokens=8192)
        >>> plan.host_bytes, plan.tokens  # 2 snapshots + window + held-out; 2 probes x 4 branches x 8,192 tokens
        (250, 65536)
    """

    points: list[int]  # token counts of the probes that fit before max_tokens
    snapshot_bytes: int  # one copy of the rank's parameters and optimizer state
    window_bytes: int  # the recorded micro-batches of one probe's windows
    heldout_bytes: int
    max_branches: int  # branches trained per probe, at most
    window_tokens: int
    replicates: int = 1  # data windows each branch's k trains on
    snapshots: int = 2  # held at once: the window's start, the main run after it, one per branch with early_stop
    side_jobs: str | None = None  # the launcher of side-job probes (their branches train elsewhere), else None
    checkpoint_bytes: int = 0  # side jobs: the checkpoint each probe writes for its job (all ranks' shards)

    @property
    def host_bytes(self) -> int:
        """Peak: the snapshots held at once and the data (side jobs: only the held-out batches the main run
        scores its own window on)."""
        if self.side_jobs is not None:
            return self.heldout_bytes
        return self.snapshots * self.snapshot_bytes + self.window_bytes + self.heldout_bytes

    @property
    def tokens(self) -> int:
        """Tokens trained in branches over the run, at most."""
        return len(self.points) * self.max_branches * self.window_tokens * self.replicates


def probe_plan(
    probe,
    shape: ModelShape,
    precision: str,
    strategy: str,
    data_parallel_size: int,
    micro_batch: int,
    val_micro_batch: int,
    seq_len: int,
    max_tokens: int,
    optimizer: OptimizerState = ADAMW_STATE,
) -> ProbePlan:
    """The cost of ``probe`` (a ``CBSProbeCallback``) on this run.

    Args:
        probe: the ``CBSProbeCallback``.
        shape: the model's parameter counts (``ModelShape.measure``).
        precision: the Trainer's ``precision``.
        strategy: ``single``, ``ddp`` or ``fsdp`` (FSDP2 shards the snapshots).
        data_parallel_size: data-parallel ranks.
        micro_batch: samples per rank per forward.
        val_micro_batch: samples per held-out batch.
        seq_len: tokens per sample.
        max_tokens: the run's token budget; probes whose span ends past it are not counted.
        optimizer: what the optimizer keeps per parameter (default AdamW's).

    Returns:
        The probe points that fit, their host memory per rank (bytes) and branch tokens.

    Raises:
        ValueError: a precision the plan does not know.

    Examples:
        >>> from lit_cbs import CBSProbeCallback
        >>> from lit_cbs.models import get_config
        >>> probe = CBSProbeCallback(every_tokens=65536, window_tokens=8192)
        >>> plan = probe_plan(probe, ModelShape.measure(get_config("tiny")), "32-true", "single", 1, 8, 8, 128, 262_144)
        >>> plan.points, plan.max_branches, plan.tokens  # 3 probes x 4 multipliers x 8,192 tokens
        ([65536, 131072, 196608], 4, 98304)
        >>> plan.snapshot_bytes  # fp32 weights and AdamW's two moments, 3 x 4 x 233,472, and 30 step counts
        2801784
    """
    from lit_cbs.probe.reading import max_branches

    config = probe.config
    points = []
    index = 0
    while (point := config.probe_point(index)) + config.span_tokens <= max_tokens:
        points.append(int(point))
        index += 1
    param_bytes, _ = precision_bytes(precision)
    shards = data_parallel_size if strategy == "fsdp" else 1
    local = math.ceil(shape.parameters / shards)
    # The weights and the optimizer's state.
    snapshot = (1 + optimizer.per_element) * local * param_bytes + optimizer.bytes_per_tensor * shape.parameter_tensors
    window_samples_per_rank = config.span_tokens // seq_len // data_parallel_size
    sample_bytes = (seq_len + 1) * TOKEN_BYTES
    heldout = config.heldout_batches * val_micro_batch * sample_bytes if config.evaluate == "heldout" else 0
    side_jobs = config.side_jobs
    return ProbePlan(
        points=points,
        snapshot_bytes=snapshot,
        window_bytes=window_samples_per_rank * sample_bytes,
        heldout_bytes=heldout,
        max_branches=max_branches(config.search, len(config.multipliers)),
        window_tokens=config.window_tokens,
        replicates=config.replicates,
        snapshots=2 + (max_branches(config.search, len(config.multipliers)) if config.early_stop else 0),
        side_jobs=type(side_jobs.launcher).__name__ if side_jobs is not None else None,
        checkpoint_bytes=snapshot * shards,
    )


def wall_seconds(flops_per_token: int, tokens: int, devices: int, peak_flops_per_device: float, mfu: float) -> float:
    """Seconds to train ``tokens`` at ``mfu`` x ``peak_flops_per_device`` FLOP/s on each of ``devices``.

    Args:
        flops_per_token: training FLOPs per token.
        tokens: tokens to train (global).
        devices: devices training them.
        peak_flops_per_device: one device's peak FLOP/s at the training precision.
        mfu: the model FLOPs utilization expected, in (0, 1].

    Returns:
        Wall-clock seconds.

    Raises:
        ValueError: ``mfu`` outside (0, 1].

    Examples:
        >>> round(wall_seconds(6 * 10**9, 10**9, 8, 989e12, 0.4), 1)  # a 1B model's 6N FLOPs on 1B tokens, 8 GPUs
        1895.9
        >>> wall_seconds(6 * 10**9, 10**9, 8, 989e12, 1.5)
        Traceback (most recent call last):
        ...
        ValueError: mfu=1.5 must be in (0, 1]
    """
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must be in (0, 1]")
    return flops_per_token * tokens / (mfu * peak_flops_per_device * devices)


# ---------------------------------------------------------------------- the whole run
@dataclasses.dataclass(frozen=True)
class Limits:
    """What the plan is checked against: memory per device and per node in GiB, the expected MFU,
    and the device's peak FLOP/s at the training precision (``plan_for.*`` in the recipes).

    Examples:
        >>> Limits(gpu_memory_gib=141.0).mfu
        0.4
    """

    gpu_memory_gib: float = 80.0
    host_memory_gib: float = 1024.0
    mfu: float = 0.4
    peak_flops_per_device: float = 989e12
    min_micro_batch_size: int = 1  # growing the cluster: no rank's micro-batch below this (samples)
    max_devices: int | None = None  # growing the cluster: at most this many ranks
    checkpoint_gib_per_s: float = 1.0  # what one rank writes to the checkpoint folder per second (side-job probes)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A run worked out before it starts (``plan_run``'s): its batch phases, memory per device with activation
    checkpointing on and off, the CBS probe's cost, the cluster grown with the batch; ``report()`` writes it
    out as ``recipes/train.py plan=true`` prints it, ``warnings()`` says what does not fit."""

    name: str
    shape: ModelShape
    seq_len: int
    max_tokens: int
    precision: str
    strategy: str
    devices_per_node: int
    num_nodes: int
    activation_checkpointing: bool
    phases: list[BatchPhase]
    memory: dict[bool, DeviceMemory]  # activation checkpointing on/off -> memory per device
    probe: ProbePlan | None
    limits: Limits
    accelerator: str
    optimizer: OptimizerState = ADAMW_STATE
    micro_batch_limit: int | None = None  # the largest micro-batch whose step fits limits.gpu_memory_gib
    cluster: list[ClusterPhase] | None = None  # the phases on a cluster grown with the batch
    command: str = "recipes/train.py"  # the run's command line, for the commands that move it between clusters
    slurm_arguments: str = ""  # its arguments for recipes/slurm/train.sbatch (which sets the nodes and devices itself)
    # Optimizer settings that move with the batch: the changes up to a phase, each (new / old global batch,
    # its LR factor) -> {column: value}, applied change by change as BatchWarmup does
    settings: Callable[[list[tuple[float, float]]], dict[str, float]] | None = None

    def _settings_of(self, phase: BatchPhase) -> dict[str, float]:
        if self.settings is None:
            return {}
        upto = self.phases[: self.phases.index(phase) + 1]
        return self.settings(
            [(new.global_batch / old.global_batch, new.lr_factor / old.lr_factor) for old, new in zip(upto, upto[1:])]
        )

    @property
    def processes(self) -> int:
        """Processes (ranks) of the run: devices per node x nodes."""
        return self.devices_per_node * self.num_nodes

    @property
    def tokens(self) -> int:
        """Tokens the main run trains on (the last step may pass max_tokens)."""
        return self.phases[-1].end_tokens if self.phases else 0

    @property
    def wall_seconds(self) -> float:
        """The main run's: with in-process probes the run waits while their branches train (counted); side-job
        probes' branches train elsewhere (``probe_device_hours``), the run waiting only for each probe's checkpoint."""
        paused = self.probe is not None and self.probe.side_jobs is None
        seconds = self._seconds(
            self.tokens + (self.probe.tokens if paused and self.probe is not None else 0), self.processes
        )
        return seconds + self.probe_checkpoint_seconds * (len(self.probe.points) if self.probe is not None else 0)

    @property
    def probe_checkpoint_seconds(self) -> float:
        """Seconds the main run waits at each side-job probe point while every rank writes its share of the
        checkpoint (FSDP2: its shard; one process or DDP: rank 0 the whole), at ``limits.checkpoint_gib_per_s``."""
        if self.probe is None or self.probe.side_jobs is None:
            return 0.0
        return self.probe.snapshot_bytes / GIB / self.limits.checkpoint_gib_per_s

    @property
    def probe_device_hours(self) -> float:
        """Device-hours of every probe's branches at the run's MFU, wherever they train."""
        return self._seconds(self.probe.tokens, 1) / 3600 if self.probe is not None else 0.0

    def _seconds(self, tokens: int, devices: int) -> float:
        flops = self.shape.flops_per_token(self.seq_len)
        return wall_seconds(flops, tokens, devices, self.limits.peak_flops_per_device, self.limits.mfu)

    def warnings(self) -> list[str]:
        """What does not fit: memory per GPU over ``limits.gpu_memory_gib``, the probe's host memory per node over
        ``limits.host_memory_gib``, each with what to change; empty when all fits."""
        found = []
        needed = self.memory[self.activation_checkpointing].total / GIB
        if self._on_gpu and needed > self.limits.gpu_memory_gib:
            fixes = "lower data.batch_size"
            if not self.activation_checkpointing and self.memory[True].total / GIB <= self.limits.gpu_memory_gib:
                fixes = "set model.activation_checkpointing=true, or " + fixes
            if self.strategy != "fsdp":
                fixes += ", or shard with trainer=fsdp"
            found.append(
                f"{needed:,.1f} GiB per GPU exceeds plan_for.gpu_memory_gib={self.limits.gpu_memory_gib:g}: {fixes}"
            )
        if self.probe is not None:
            per_node = self.probe.host_bytes * self.devices_per_node / GIB
            if per_node > self.limits.host_memory_gib:
                found.append(
                    f"the CBS probe holds {per_node:,.1f} GiB of host memory per node ({self.devices_per_node} ranks), "
                    f"more than plan_for.host_memory_gib={self.limits.host_memory_gib:g}: use more nodes (FSDP2 shards "
                    "the snapshots), a smaller callbacks.cbs_probe.window_tokens, or snapshot_device=cuda"
                )
        return found

    def report(self) -> str:
        """The plan as ``recipes/train.py plan=true`` prints it: model, processes, batch phases, memory per device,
        the probe, wall time and the cluster grown with the batch."""
        c = self.shape.config
        strategy = {"fsdp": f"FSDP2 over {self.processes} ranks", "ddp": "DDP", "single": "one process"}[self.strategy]
        lines = [
            f"lit_cbs plan: {self.name} (nothing trained, no data read)",
            f"model            {c.n_layers} layers x d_model {c.d_model}, {self.shape.parameters:,} parameters, "
            f"{self.shape.flops_per_token(self.seq_len):.3g} FLOPs per token (training) at {self.seq_len:,} tokens",
            f"processes        {self.processes} ({self.num_nodes} node{'s' if self.num_nodes > 1 else ''} x "
            f"{self.devices_per_node} {'GPU' if self.accelerator in ('gpu', 'cuda') else self.accelerator}), "
            f"{strategy}, precision {self.precision}",
            f"tokens           {self.tokens:,} in {sum(p.optimizer_steps for p in self.phases):,} optimizer steps "
            f"(max_tokens={self.max_tokens:,})",
            "",
            "batch schedule   (global batch in samples of seq_len tokens; "
            "accumulation = micro-batches per step per rank)",
            f"  {'from tokens':>17} {'tokens':>17} {'global':>7} {'micro':>6} {'accum':>6} {'steps':>9} {'LR x':>6}"
            + "".join(
                f" {column:>{max(8, len(column))}}" for column in self._settings_of(self.phases[0]) if self.phases
            ),
        ]
        for p in self.phases:
            lines.append(
                f"  {p.start_tokens:>17,} {p.tokens:>17,} {p.global_batch:>7,} {p.micro_batch:>6} {p.accumulate:>6} "
                f"{p.optimizer_steps:>9,} {p.lr_factor:>6.3g}"
                + "".join(f" {value:>{max(8, len(column))}.4g}" for column, value in self._settings_of(p).items())
            )
        on, off = self.memory[True], self.memory[False]
        chosen = "on" if self.activation_checkpointing else "off"
        micro = max(p.micro_batch for p in self.phases) if self.phases else 0  # the peak
        working = {"fsdp": "gathered params, grads", "ddp": "DDP grad buckets", "single": "autocast copies"}[
            self.strategy
        ]
        unit, size = ("GiB", GIB) if off.total >= GIB else ("MiB", 2**20)
        lines += [
            "",
            f"memory per {'GPU' if self.accelerator in ('gpu', 'cuda') else 'device'} ({unit}) "
            f"at micro-batch {micro} x {self.seq_len:,} tokens; "
            f"activation checkpointing {chosen} (model.activation_checkpointing)",
            f"  {'':<24} {'AC on':>8} {'AC off':>8}",
        ]
        rows = [
            ("parameters", on.parameters, off.parameters),
            ("gradients", on.gradients, off.gradients),
            (f"{self.optimizer.name} state", on.optimizer_state, off.optimizer_state),
            (working, on.working_buffers, off.working_buffers),
            ("activations (saved)", on.activations, off.activations),
            ("activations (peak add)", on.activation_peak_extra, off.activation_peak_extra),
            ("total", on.total, off.total),
        ]
        lines += [f"  {label:<24} {a / size:>8.2f} {b / size:>8.2f}" for label, a, b in rows]
        if self._on_gpu:
            lines.append(
                f"  (plus CUDA context, communication buffers and fragmentation; limit plan_for.gpu_memory_gib="
                f"{self.limits.gpu_memory_gib:g})"
            )
        else:
            lines.append(
                f"  (host memory of each process on {self.accelerator}; plan_for.gpu_memory_gib applies to GPUs only)"
            )
        lines.append("")
        if self.probe is None:
            lines.append("CBS probe        none")
        else:
            probe = self.probe
            windows = f" on each of {probe.replicates} data windows" if probe.replicates > 1 else ""
            lines.append(
                f"CBS probe        {len(probe.points)} probes fit (at {', '.join(f'{t:,}' for t in probe.points[:6])}"
                f"{', ...' if len(probe.points) > 6 else ''} tokens), up to {probe.max_branches} branches of "
                f"{probe.window_tokens:,} tokens each{windows}: up to {probe.tokens:,} tokens "
                f"({probe.tokens / max(1, self.tokens):.1%} of training)"
            )
            if probe.side_jobs is not None:
                hours = f"{self.probe_device_hours:,.0f} device-hours" if self._on_gpu else "their own devices"
                write = self.probe_checkpoint_seconds
                lines += [
                    f"  as side jobs ({probe.side_jobs}): the branches train on {hours} beside the main run, "
                    "which does not wait for them; each probe writes a "
                    f"{probe.checkpoint_bytes / GIB:,.2f} GiB checkpoint for its job (deleted once its reading is in), "
                    f"which the main run waits for: {_duration(write)} a probe point at "
                    f"plan_for.checkpoint_gib_per_s={self.limits.checkpoint_gib_per_s:g} per rank, "
                    f"{_duration(write * len(probe.points))} in all",
                    f"  host memory per rank {probe.host_bytes / GIB:,.2f} GiB: the held-out batches the main run "
                    "scores its own window on (no snapshot, no recorded window)",
                ]
            else:
                lines.append(
                    f"  host memory per rank {probe.host_bytes / GIB:,.2f} GiB: {probe.snapshots} snapshots of "
                    f"{probe.snapshot_bytes / GIB:,.2f} (weights + {self.optimizer.name} state), window batches "
                    f"{probe.window_bytes / GIB:,.2f}, held-out {probe.heldout_bytes / GIB:,.2f}; "
                    f"{probe.host_bytes * self.devices_per_node / GIB:,.1f} GiB per node "
                    f"(limit plan_for.host_memory_gib={self.limits.host_memory_gib:g})"
                )
        seconds = self.wall_seconds
        if self._on_gpu:
            if self.probe is None:
                pauses = ""
            elif self.probe.side_jobs is not None:
                writes = _duration(self.probe_checkpoint_seconds * len(self.probe.points))
                pauses = f" (side-job probes pause it only for their checkpoints: {writes})"
            else:
                alone = self._seconds(self.tokens, self.processes)
                pauses = f", of which the run waits {_duration(seconds - alone)} for its in-process probes"
            lines += [
                "",
                f"wall time        {_duration(seconds)} at MFU {self.limits.mfu:.0%} (plan_for.mfu) of "
                f"{self.limits.peak_flops_per_device / 1e12:,.0f} TFLOP/s per device "
                "(model.peak_flops_per_device, else plan_for.peak_flops_per_device), "
                f"{self.processes * seconds / 3600:,.0f} device-hours{pauses}",
            ]
        else:
            lines += [
                "",
                f"wall time        not estimated on {self.accelerator} (the estimate assumes a GPU's peak FLOP/s, "
                "plan_for.peak_flops_per_device)",
            ]
        if self.micro_batch_limit is not None:
            lines.append(
                f"micro-batch      the largest that fits plan_for.gpu_memory_gib={self.limits.gpu_memory_gib:g}: "
                f"{self.micro_batch_limit} samples per device (batch.max_micro_batch_size={self.micro_batch_limit}: "
                "each phase then trains at the largest divisor of a rank's share up to it, the accumulation after)"
            )
        lines += self._cluster_report()
        warnings = self.warnings()
        fits = (
            "memory per device and host memory within plan_for's limits"
            if self._on_gpu
            else "host memory within plan_for.host_memory_gib"
        )
        lines += [f"WARNING: {w}" for w in warnings] or [f"fits             {fits}"]
        return "\n".join(lines)

    def _cluster_report(self) -> list[str]:
        """Each phase on the ranks ``grow_cluster`` gives it, against the whole run on the ranks of now."""
        if not self.cluster or len(self.cluster) < 2:
            return []
        per_node = self.devices_per_node
        timed = self._on_gpu
        grown = sum(self._seconds(p.phase.tokens, p.ranks) for p in self.cluster)
        fixed = sum(self._seconds(p.phase.tokens, self.processes) for p in self.cluster)
        cap = f", plan_for.max_devices={self.limits.max_devices}" if self.limits.max_devices else ""
        times = f" {'tokens/s':>12} {'wall time':>12} {f'on {self.processes} ranks':>14}" if timed else ""
        lines = [
            "",
            "growing the cluster with the batch: each phase on the fewest whole nodes that keep a rank's share "
            "of a step at the first phase's, "
            f"micro-batch >= plan_for.min_micro_batch_size={self.limits.min_micro_batch_size}{cap}",
            f"  {'from tokens':>17} {'global':>7} {'ranks':>6} {'micro':>6} {'accum':>6}{times}",
        ]
        for planned in self.cluster:
            row = (
                f"  {planned.phase.start_tokens:>17,} {planned.phase.global_batch:>7,} {planned.ranks:>6} "
                f"{planned.micro_batch:>6} {planned.accumulate:>6}"
            )
            if timed:
                seconds = self._seconds(planned.phase.tokens, planned.ranks)
                row += (
                    f" {planned.phase.tokens / seconds:>12,.0f} {_duration(seconds):>12} "
                    f"{_duration(self._seconds(planned.phase.tokens, self.processes)):>14}"
                )
            lines.append(row)
        device_hours = sum(p.ranks * self._seconds(p.phase.tokens, p.ranks) for p in self.cluster) / 3600
        if timed:
            lines.append(
                f"  wall time {_duration(grown)} against {_duration(fixed)} on {self.processes} ranks throughout "
                f"({fixed / grown:.2f}x sooner; {device_hours:,.0f} device-hours either way at the same MFU; "
                "probes not counted)"
            )
        lines.append(
            "  stop each phase where the batch grows (trainer.max_steps) and resume the run on the next phase's nodes:"
        )
        for index, planned in enumerate(self.cluster):
            nodes = planned.ranks // per_node
            run_dir = f" hydra.run.dir=outputs/{self.name}/phase{index + 1}"
            resume = f" ckpt_path=outputs/{self.name}/phase{index}/checkpoints/last.ckpt" if index else ""
            stop = f" trainer.max_steps={planned.end_step}" if index < len(self.cluster) - 1 else ""
            lines.append(
                f"    torchrun --nnodes {nodes} --nproc_per_node {per_node} {self.command} "
                f"trainer.num_nodes={nodes}{stop}{run_dir}{resume}"
            )
        lines.append(
            "  or as SLURM jobs, each after the one before (recipes/slurm/train.sbatch sets the nodes and devices):"
        )
        for index, planned in enumerate(self.cluster):
            nodes = planned.ranks // per_node
            after = " --dependency=afterok:<the previous job's id>" if index else ""
            resume = f" ckpt_path=outputs/{self.name}/phase{index}/checkpoints/last.ckpt" if index else ""
            stop = f" trainer.max_steps={planned.end_step}" if index < len(self.cluster) - 1 else ""
            lines.append(
                f"    RUN_DIR=outputs/{self.name}/phase{index + 1} sbatch --nodes={nodes} "
                f"--ntasks-per-node={per_node}{after} recipes/slurm/train.sbatch {self.slurm_arguments}{stop}{resume}"
            )
        return lines

    @property
    def _on_gpu(self) -> bool:
        return on_gpu(self.accelerator)


def on_gpu(accelerator: str) -> bool:
    """Whether a run on ``accelerator`` trains on GPUs: only then are wall times estimated (they assume a
    GPU's peak FLOP/s, plan_for.peak_flops_per_device) and memory held against plan_for.gpu_memory_gib.

    Examples:
        >>> on_gpu("cuda"), on_gpu("cpu")
        (True, False)
    """
    return accelerator in ("gpu", "cuda")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:,.1f} hours"
    return f"{seconds / 60:,.1f} minutes"


def plan_run(
    name: str,
    config: OLMoConfig | object,
    schedule: BatchSchedule,
    lr_factor: Callable[[float], float],
    max_tokens: int,
    seq_len: int,
    micro_batch: int,
    val_micro_batch: int,
    precision: str,
    strategy: str,
    accelerator: str,
    devices_per_node: int,
    num_nodes: int,
    activation_checkpointing: bool,
    probe=None,
    limits: Limits = Limits(),
    optimizer: OptimizerState = ADAMW_STATE,
    max_micro_batch_size: int | None = None,
    command: str = "recipes/train.py",
    slurm_arguments: str = "",
    settings: Callable[[list[tuple[float, float]]], dict[str, float]] | None = None,
) -> RunPlan:
    """The plan of a run; ``probe`` is its CBSProbeCallback, if any; ``optimizer`` what its optimizer
    keeps (``OptimizerState.measure(factory)``). All ranks are data-parallel. ``micro_batch``: the first
    micro-batch, or with ``max_micro_batch_size`` what BatchWarmup grows it to with each batch.

    Args:
        name: the run's name (its folder under ``outputs/``).
        config: the model's ``OLMoConfig`` or ``transformers`` config.
        schedule: the batch schedule (global batches in samples).
        lr_factor: batch ratio new / old -> LR factor (the LR rule's ``factor``).
        max_tokens: the token budget (global).
        seq_len: tokens per sample.
        micro_batch: samples per rank per forward (the first, with ``max_micro_batch_size``).
        val_micro_batch: samples per validation (and held-out) batch.
        precision: the Trainer's ``precision``.
        strategy: ``single``, ``ddp`` or ``fsdp``.
        accelerator: the Trainer's ``accelerator``; wall times and GPU memory limits only on GPUs.
        devices_per_node: devices per node.
        num_nodes: nodes.
        activation_checkpointing: whether the blocks recompute their activations in backward.
        probe: the run's ``CBSProbeCallback``, or None.
        limits: what the plan is checked against.
        optimizer: what the optimizer keeps per parameter.
        max_micro_batch_size: BatchWarmup's cap on the micro-batch it grows (samples), or None to keep it.
        command: the run's command line, for the commands that move it between clusters.
        slurm_arguments: its arguments for ``recipes/slurm/train.sbatch``.
        settings: the optimizer settings that move with the batch, change by change (the report's columns).

    Returns:
        The plan.

    Raises:
        ValueError: an unknown ``precision`` or ``strategy``.

    Examples:
        The tiny model on one CPU process, its batch doubled at 65,536 tokens:

        >>> from lit_cbs.models import get_config
        >>> from lit_cbs.rules.batch_schedules import PiecewiseBatch
        >>> schedule = PiecewiseBatch(thresholds=[0, 65536], batch_sizes=[8, 16], unit="tokens")
        >>> plan = plan_run("demo", get_config("tiny"), schedule, lambda ratio: ratio**0.5, max_tokens=200_000,
        ...                 seq_len=128, micro_batch=8, val_micro_batch=8, precision="32-true", strategy="single",
        ...                 accelerator="cpu", devices_per_node=1, num_nodes=1, activation_checkpointing=False)
        >>> plan.tokens, sum(phase.optimizer_steps for phase in plan.phases), plan.warnings()
        (200704, 130, [])
        >>> print(plan.report())
        lit_cbs plan: demo (nothing trained, no data read)
        model            4 layers x d_model 64, 233,472 parameters, 1.7e+06 FLOPs per token (training) at 128 tokens
        ...
    """
    shape = ModelShape.measure(config)
    processes = devices_per_node * num_nodes

    def micro_for(global_batch: int, ranks: int) -> int:
        return micro_batch_for(global_batch, ranks, max_micro_batch_size) if max_micro_batch_size else micro_batch

    phases = batch_phases(
        schedule, max_tokens, seq_len, lambda batch: micro_for(batch, processes), processes, lr_factor
    )
    peak_micro = max(p.micro_batch for p in phases) if phases else micro_batch

    def memory_at(micro: int, checkpointing: bool = activation_checkpointing) -> DeviceMemory:
        return device_memory(shape, micro, seq_len, precision, strategy, processes, checkpointing, optimizer)

    memory = {checkpointing: memory_at(peak_micro, checkpointing) for checkpointing in (True, False)}
    largest_share = max(schedule.sizes()) // processes
    return RunPlan(
        name=name,
        shape=shape,
        seq_len=seq_len,
        max_tokens=max_tokens,
        precision=str(precision),
        strategy=strategy,
        devices_per_node=devices_per_node,
        num_nodes=num_nodes,
        activation_checkpointing=activation_checkpointing,
        phases=phases,
        memory=memory,
        probe=None
        if probe is None
        else probe_plan(
            probe, shape, precision, strategy, processes, micro_batch, val_micro_batch, seq_len, max_tokens, optimizer
        ),
        limits=limits,
        accelerator=accelerator,
        optimizer=optimizer,
        micro_batch_limit=largest_micro_batch(limits.gpu_memory_gib * GIB, largest_share, memory_at)
        if on_gpu(accelerator)
        else None,
        cluster=grow_cluster(
            phases, processes, devices_per_node, limits.min_micro_batch_size, limits.max_devices, micro_for
        )
        if phases
        else None,
        command=command,
        slurm_arguments=slurm_arguments,
        settings=settings,
    )
