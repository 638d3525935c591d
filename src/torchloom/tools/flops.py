"""`estimate_flops`: the floating-point operations of one training micro-batch, counted on fake tensors.

The model is built or copied as `torchloom.estimate_memory` builds it (`torchloom.tools.memory_source`: a model
directory, a transformers config, a module, a callable; nothing allocated), one forward and backward of a micro-batch
runs on fake tensors, and `torch.utils.flop_counter.FlopCounterMode` adds up the FLOPs of every matrix multiplication,
convolution and attention operation it dispatches (PyTorch's own formulas: ``2 * m * n * k`` for a matmul, with
backward counted as the two matmuls it performs). For a transformer this is the figure of PaLM's appendix B,
``6 * N * T + 12 * L * d * T**2`` per sequence of ``T`` tokens (``N`` the weights of the linear layers, the output
head included and the input embedding not; ``L`` layers of width ``d``; the attention counted over the whole
square, as the kernels compute it): tests/test_flops.py checks it on GPT-2 and Llama configs.
"""

from __future__ import annotations

from typing import Any

import torch

from torchloom.errors import ConfigError
from torchloom.tools.memory_source import ForwardFn, fake_copy, load_source

__all__ = ["estimate_flops"]


def _attention_formulas() -> dict[Any, Any]:
    """`FlopCounterMode` formulas (its ``custom_mapping``) that make the fused attention kernels count model FLOPs.

    torch 2.13 has no formula for the CPU's fused attention (``_scaled_dot_product_flash_attention_for_cpu`` and
    its backward: transformers' ``sdpa`` on a CPU would count 0), and its formula for the CUDA kernels' backward
    counts their recomputation of the attention scores (hardware FLOPs). Here every fused attention counts
    ``sdpa_flop_count`` forward (``4 * b * h * s_q * s_k * d``, the two matmuls) and twice that backward, as the
    same attention written with matmuls counts, and as PaLM's model FLOPs count it.
    """
    from torch.utils import flop_counter

    def forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return int(flop_counter.sdpa_flop_count(query, key, value))

    def backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * int(flop_counter.sdpa_flop_count(query, key, value))

    aten, formulas = torch.ops.aten, {}
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", forward),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", backward),
        ("_scaled_dot_product_flash_attention_backward", backward),
        ("_scaled_dot_product_efficient_attention_backward", backward),
        ("_scaled_dot_product_cudnn_attention_backward", backward),
    ):
        op = getattr(aten, name, None)
        if op is not None:
            formulas[op] = formula
    return formulas


def estimate_flops(
    model: Any,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    forward: ForwardFn | None = None,
    architecture: str | None = None,
) -> int:
    """The model FLOPs of one training micro-batch: one forward and one backward, on fake tensors.

    Counts what the model computes (matrix multiplications, convolutions, attention; element-wise operations are
    not counted), as `torch.utils.flop_counter.FlopCounterMode` does; not the recomputation of gradient
    checkpointing (model FLOPs, not hardware FLOPs) and not the optimizer step. Nothing is allocated: the model is
    a fake copy (`torch._subclasses.fake_tensor.FakeTensorMode`), the same as `torchloom.estimate_memory` traces.

    Args:
        model: what `torchloom.estimate_memory` takes: a local Hugging Face model directory, a transformers config,
            a `torch.nn.Module` (copied, not changed) or a callable that returns one.
        batch_size (`int`, defaults to 1): rows of the micro-batch.
        seq_len (`int`, *optional*): tokens per row (transformers models; default their
            ``max_position_embeddings``).
        forward (`callable`, *optional*): ``forward(model, batch_size, seq_len) -> loss``, for a model that is not a
            transformers model (it makes its own fake inputs).
        architecture (`str`, *optional*): the transformers class to build from a config (default its
            ``architectures[0]``, else the base model).

    Returns:
        `int`: FLOPs of the forward and backward of one micro-batch.

    Raises:
        ConfigError: a model that cannot be built or run on fake tensors, a bad ``batch_size`` or ``seq_len``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"estimate_flops: {name} = {value!r}; expected an integer >= 1")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # The model as the task builds it: a run config's peft plugin is not applied here (estimate_memory applies it).
    source = load_source(model, architecture, forward, mode, caller="estimate_flops", peft=False)
    if source.needs_seq_len and seq_len is None:
        seq_len = source.max_len
        if seq_len is None:
            raise ConfigError(f"estimate_flops: {source.label} has no max_position_embeddings; pass seq_len")
    with mode:
        fake = fake_copy(source.prototype, mode)
        fake.train()
        batch = source.make_batch(fake, batch_size, seq_len) if source.make_batch is not None else None
        counter = FlopCounterMode(display=False, custom_mapping=_attention_formulas())
        try:
            with counter:
                loss = source.loss(fake, batch, batch_size, seq_len)
                torch.as_tensor(loss).float().sum().backward()
        except Exception as exc:
            raise ConfigError(
                f"estimate_flops: the forward and backward of {source.label} (micro-batch {batch_size}, seq_len "
                f"{seq_len}) failed on fake tensors: {type(exc).__name__}: {exc}"
            ) from exc
    return int(counter.get_total_flops())
