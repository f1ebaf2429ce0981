"""FLOPs and memory traffic per token of a decoder-only transformer (pure, from ``ModelShape``).

"Model FLOPs" (the basis of MFU) follow PaLM (Chowdhery et al. 2022, appendix B) and
Megatron-LM's ``num_floating_point_operations``: 2 FLOPs per multiply-add, forward + backward =
3 x forward, attention's two s x s matmuls not halved for the causal mask, recomputation not
credited. The planner adds recomputation's extra forward on top (hardware FLOPs).
"""

from __future__ import annotations

from toolkit.memory import ModelShape
from toolkit.memory.activations import DELTA_CHUNK
from toolkit.memory.model import EXPERT, VOCAB


def matmul_params_per_token(shape: ModelShape) -> int:
    """Weights one token is multiplied with: all parameters except the input embedding (and
    learned position) lookups, MoE experts counted top_k/experts, plus the output projection
    (counted even when tied to the embedding, because the head matmul still happens)."""
    total = 0
    for t in shape.tensors():
        if t.name in ("embed", "pos_embed"):
            continue
        total += t.numel * shape.top_k // shape.experts if t.split == EXPERT else t.numel
    if shape.tied:
        total += shape.vocab * shape.hidden
    return total


def model_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward, no recompute) of a dense or MoE GPT:

        6 * N + 12 * L * H * s

    N = ``matmul_params_per_token`` (active parameters, non-embedding, plus the LM head); the
    second term is attention's score and value matmuls (QK^T and AV: 2 matmuls x 2 FLOPs per
    multiply-add x 3 for forward + backward, over L layers of H = heads * head_dim attention width
    and s keys) - only the layers with softmax attention; gated DeltaNet layers add
    3 x ``delta_forward_flops`` instead. With LoRA (``shape.lora``) the frozen weights need no
    weight gradient: 4 * N (the adapters' own FLOPs are left out, as biases and norms are)."""
    weights = 4.0 if shape.lora else 6.0
    attention = 12.0 * attention_layers(shape, range(shape.layers)) * shape.q_dim * seq_len
    delta = 3.0 * len(shape.delta_layers) * delta_forward_flops(shape)
    return weights * matmul_params_per_token(shape) + attention + delta


def attention_layers(shape: ModelShape, layers: range | tuple[int, ...]) -> int:
    """How many of ``layers`` have softmax attention (s x s scores), not a gated DeltaNet."""
    return sum(1 for i in layers if i not in shape.delta_layers)


def delta_forward_flops(shape: ModelShape) -> float:
    """One token's forward FLOPs in one gated DeltaNet layer besides its projections (fla's
    chunked rule, chunk C = 64): per value head, the in-chunk products (K K^T, Q K^T, the
    triangular solve for K and V, A V: about C * (2 dk + 2 dv) multiply-adds) and the state's
    read, correction and update (3 dk x dv). Linear in the sequence: no s term."""
    dn = shape.delta
    if dn is None:
        return 0.0
    per_head = DELTA_CHUNK * (2 * dn.k_dim + 2 * dn.v_dim) + 3 * dn.k_dim * dn.v_dim
    return 2.0 * dn.v_heads * per_head


def layer_matmul_params(shape: ModelShape) -> list[float]:
    """Per decoder layer, the weights one token is multiplied with (norms and biases excluded,
    experts counted top_k of them), from the memory model's one list of tensors."""
    per_layer = [0.0] * shape.layers
    for t in shape.tensors():
        if t.layer is None or "norm" in t.name or "bias" in t.name:
            continue
        per_layer[t.layer] += (t.numel * shape.top_k / shape.experts if t.split == EXPERT
                               else t.numel)
    return per_layer


def head_forward_flops(shape: ModelShape) -> float:
    """One token's forward through the output projection (vocabulary logits)."""
    head = [t for t in shape.tensors() if t.split == VOCAB]
    return 2.0 * head[-1].numel if head else 0.0


def layer_elementwise_elements(shape: ModelShape, layer: int) -> tuple[float, float]:
    """Tensor elements one token's forward reads and writes outside the matmuls of ``layer``:
    (hidden-wide part, part inside the tensor-parallel region).

    Hidden-wide (split only by sequence parallelism): two norms (read + write h each) and two
    residual adds (read 2h, write h). Inside the TP region: RoPE reads and writes Q and K, the
    activation reads its input(s) and writes its output (SwiGLU: 2f in, f out; GeLU: f in, f
    out), MoE routing copies each token to its top_k experts and back (2 x top_k x h) and reads
    fp32 router logits (E). Backward is counted as twice this by the cost model."""
    h = shape.hidden
    whole = 4.0 * h + 6.0 * h
    rope = 0.0 if shape.learned_positions else 2.0 * (shape.q_dim + shape.kv_dim)
    act = 3.0 if shape.gated_mlp else 2.0
    if shape.is_moe_layer(layer):
        mlp = act * shape.moe_ffn * shape.top_k + 2.0 * shape.top_k * h + 2.0 * shape.experts
        mlp += act * shape.shared_ffn
    else:
        mlp = act * shape.ffn
    return whole, rope + mlp
