"""A block's Linear weights (and a GGUF's token embedding) held in llama.cpp's block formats (``--quantize q8_0|...``).

Owns: which weights a scheme takes, reading them (the model's own GGUF, or a float checkpoint quantized at load),
attaching them to the Linear modules (whose forward then runs :func:`swarm.kernels.qblocks.linear`), routed experts
held as :class:`QExperts`, and the bytes held (:func:`held_bytes`). Formats and figures: docs/kernels.md.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from swarm.errors import ConfigError, ModelError
from swarm.kernels.qblocks import QWeight

log = logging.getLogger(__name__)

QUANTIZED_AT_LOAD = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")  # a float checkpoint written in these at load
SCHEMES = (*QUANTIZED_AT_LOAD, "gguf")  # gguf: the blocks of the GGUF file the model was converted from
ATTR = "swarm_qweight"  # the QWeight a Linear module holds, in its __dict__ (its weight parameter is emptied)


def compute_dtype(scheme: str, dtype: str, device: torch.device) -> str:
    """The dtype a block held in ``scheme`` computes in (float32), checked against ``dtype`` and ``device``.

    Raises:
        ConfigError: not the CPU, or a dtype other than float32.
    """
    if device.type != "cpu":
        raise ConfigError(f"--quantize {scheme} runs on the CPU (swarm's block-format kernels), not {device}")
    if dtype not in ("auto", "float32"):
        raise ConfigError(f"--quantize {scheme} computes in float32 (activations); --dtype {dtype} cannot go with it")
    return "float32"


def linear_of(owner: torch.nn.Module, pname: str) -> torch.nn.Linear | None:
    """The Linear whose ``weight`` is ``owner``'s parameter ``pname`` (``self_attn.q_proj.weight``), or None."""
    *path, leaf = pname.split(".")
    mod = owner
    for part in path:
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod if isinstance(mod, torch.nn.Linear) and leaf == "weight" else None


def hold(linear: torch.nn.Linear, q: QWeight) -> int:
    """Attach ``q`` to ``linear`` (its float weight freed); returns the bytes held.

    Raises:
        ModelError: ``q``'s shape is not the Linear's.
    """
    return _attach(linear, q, (linear.out_features, linear.in_features), "Linear")


def _attach(module: torch.nn.Module, q: QWeight, shape: tuple[int, int], kind: str) -> int:
    """Put ``q`` in ``module``'s ``__dict__`` (``ATTR``) and free its float weight; returns the bytes held.

    Raises:
        ModelError: ``q`` is not ``shape`` (the module's (N, K)).
    """
    if (q.n, q.k) != shape:
        raise ModelError(f"a {q.fmt} matrix of ({q.n}, {q.k}) does not fit the {kind} of {shape}")
    module.__dict__[ATTR] = q
    module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    return q.nbytes


def hold_embedding(embedding: torch.nn.Embedding, q: QWeight) -> int:
    """Attach ``q`` (the token embedding, a (V, D) block-format matrix) to ``embedding``, whose lookups then
    dequantize only the rows asked for (the gguf package's values: the float expansion's bits); returns
    the bytes held.

    Raises:
        ModelError: ``q``'s shape is not the embedding's.
    """
    from swarm.kernels import qblocks

    held = _attach(embedding, q, (embedding.num_embeddings, embedding.embedding_dim), "embedding")

    def forward(ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= q.n):
            raise IndexError(f"token ids must lie in [0, {q.n}), got {int(flat.min())}..{int(flat.max())}")
        rows = qblocks.dequantize(QWeight(q.fmt, flat.numel(), q.k, q.data[flat]))
        return rows.reshape(*ids.shape, q.k).to(ids.device)

    embedding.forward = forward
    return held


def gguf_weights(model_dir: Path, config, layer_range, *, head: bool, tail: bool) -> dict[str, QWeight]:
    """The GGUF file's block-format matrices for ``layer_range`` by Hugging Face parameter name.

    Raises:
        ConfigError: ``model_dir`` is not a conversion of a GGUF file that still exists.
        ModelError: the file's tensors do not fit (gguf_tensors names the tensor).
    """
    tensors = _gguf_tensors(model_dir, config, layer_range, head, tail)
    return {name: t for name, t in tensors.items() if isinstance(t, QWeight)}


MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)  # x @ W[e]


class QExpert:
    """One expert's matrix in a block format, as an experts module's loop uses ``W[e]``: ``F.linear(x, W[e])``
    (``transposed`` False: the stored (N, K) rows) or gpt-oss's ``x @ W[e]`` (True: W[e] is (K, N), held as
    its transpose). Both run :func:`swarm.kernels.qblocks.linear` on x's rows in float32 and return x's
    dtype; any other use raises TypeError (through ``__torch_function__``)."""

    def __init__(self, q: QWeight, transposed: bool):
        self.q, self.transposed = q, transposed

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2 and isinstance(args[1], cls) and not args[1].transposed:
            x, w, bias = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
        elif func in MATMULS and len(args) == 2 and isinstance(args[1], cls) and args[1].transposed:
            (x, w), bias = args, None
        else:
            return NotImplemented
        from swarm.kernels import qblocks

        out = qblocks.linear(x.reshape(-1, w.q.k).float(), w.q, None if bias is None else bias.float())
        return out.reshape(*x.shape[:-1], w.q.n).to(x.dtype)


class QExperts:
    """An experts module's stacked matrices (E, N, K) held as E experts in their own formats (:class:`QExpert`,
    ``swarm.model.qcheckpoint.HeldExpert``); ``experts[e]`` (an int or a 0-d tensor) is expert e's."""

    def __init__(self, experts: list):
        self.experts = experts

    def __getitem__(self, e):
        return self.experts[int(e)]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.experts)


EXPERT_MATRICES = ("gate_up_proj", "down_proj")  # transformers' fused experts (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss)


def quantize_experts(module: torch.nn.Module, scheme: str) -> tuple[int, int]:
    """Hold ``module``'s (an ``...Experts`` module's) fused expert matrices in ``scheme``, each expert quantized
    by :func:`swarm.kernels.qblocks.quantize` (in ``format_for(scheme, K)``); a matrix whose inputs fit no
    format stays as it is. Returns (bytes held minus the float bytes freed, matrices kept in float)."""
    from swarm.kernels import qblocks

    transposed = type(module).__name__ == "GptOssExperts"  # x @ W[e]: W[e] is (K, N)
    delta = kept = 0
    for pname in EXPERT_MATRICES:
        p = module._parameters.get(pname)
        if p is None or p.dim() != 3:
            continue
        fmt = qblocks.format_for(scheme, p.shape[1] if transposed else p.shape[2])
        if fmt is None:
            kept += 1
            continue
        held = QExperts([QExpert(qblocks.quantize((p[e].t() if transposed else p[e]).detach(), fmt), transposed)
                         for e in range(p.shape[0])])
        del module._parameters[pname]
        module.__dict__[pname] = held
        delta += held.nbytes - p.numel() * p.element_size()
    return delta, kept


def quantize_loaded(block, scheme: str) -> None:
    """Hold the block's decoder-layer Linear weights, its routed experts (:func:`quantize_experts`) and its
    LM head (tied or not: the embedding keeps its own float copy) in ``scheme`` (one of
    :data:`QUANTIZED_AT_LOAD`) by :func:`swarm.kernels.qblocks.quantize`: each weight in
    ``format_for(scheme, K)``, float32 where no format fits (both logged). ``loaded_bytes`` becomes what is
    held."""
    from swarm.kernels import qblocks

    targets = [m for m in block.layers.modules() if isinstance(m, torch.nn.Linear)]
    if isinstance(block.lm_head, torch.nn.Linear):
        targets.append(block.lm_head)
    kept = fell_back = 0
    for mod in targets:
        fmt = qblocks.format_for(scheme, mod.in_features)
        if fmt is None:
            kept += 1
            continue
        fell_back += fmt != scheme
        w = mod.weight
        q = qblocks.quantize(w.detach(), fmt)
        shared = block.lm_head is mod and block.embed is not None and block.embed.weight is w
        block.loaded_bytes += hold(mod, q) - (0 if shared else w.numel() * w.element_size())
    experts = [m for m in block.layers.modules() if type(m).__name__.endswith("Experts")]
    for mod in experts:
        delta, kept_here = quantize_experts(mod, scheme)
        block.loaded_bytes += delta
        kept += kept_here
    if fell_back:
        log.info("quantize.fallback layers=%s scheme=%s format=%s weights=%d of %d: inputs not a multiple of %d",
                 block.layer_range, scheme, qblocks.FALLBACK[scheme], fell_back, len(targets),
                 qblocks.FORMATS[scheme].block)
    if kept:
        log.warning("quantize.kept_float32 layers=%s scheme=%s weights=%d of %d: inputs not a multiple of 32",
                    block.layer_range, scheme, kept, len(targets) + 2 * len(experts))


def require_kernels(scheme: str) -> None:
    """Block formats are multiplied by swarm's kernel library (any ISA, any kernel mode of the rest of the
    block): refuse where it does not load (``load_block`` and ``swarm stage --check`` alike).

    Raises:
        ConfigError: the library does not load, with the reason.
    """
    from swarm.kernels import fma

    ok, why = fma.library_available()
    if not ok:
        raise ConfigError(f"--quantize {scheme} needs swarm's CPU kernels, which do not load here: {why}")


def _is_linear_weight(name: str) -> bool:
    return name == "lm_head.weight" or (".layers." in name and name.endswith(("_proj.weight", "_proj_with_mqa.weight",
                                                                             "shared_expert_gate.weight")))


def _held_as_blocks(name: str) -> bool:  # by load_block with --quantize gguf: Linear weights and the embedding
    return _is_linear_weight(name) or name.endswith(".embed_tokens.weight")


def held_bytes(model_dir: Path, layer_range, scheme: str) -> int:
    """The weight bytes a block of ``layer_range`` holds in ``scheme`` (what ``load_block`` reports): its
    Linear weights and LM head in the block format, every other tensor float32 (the GGUF's or the
    checkpoint's). Reads headers only (the GGUF file's, or the safetensors')."""
    from transformers import AutoConfig

    from swarm.model.plan import model_shapes
    from swarm.weights.select import select_tensors

    config = AutoConfig.from_pretrained(str(model_dir))  # preflight has checked it (block.load_config)
    head, tail = layer_range.start == 0, layer_range.end == config.num_hidden_layers
    if scheme == "gguf":
        tensors = _gguf_tensors(model_dir, config, layer_range, head, tail)
        total, seen = 0, set()
        for name, t in tensors.items():
            if id(t) in seen:  # a tied head and tail in one stage hold one matrix
                continue
            seen.add(id(t))
            if isinstance(t, QWeight):
                total += t.nbytes if _held_as_blocks(name) else t.n * t.k * 4
            else:
                total += t.numel() * 4
        return total
    shapes = model_shapes(model_dir)
    names = list(select_tensors(shapes.shapes, shapes.config, layer_range))
    total = 0
    for name in names:
        shape = shapes.shapes[name]
        k = _expert_k(name, shape, config.model_type)
        if k is None and _is_linear_weight(name) and len(shape) == 2:
            k = shape[1]
        total += _held(scheme, _numel(shape), k)
    if tail and getattr(config, "tie_word_embeddings", False):  # the tied LM head: quantized from the embedding
        n, k = shapes.shapes.get("model.embed_tokens.weight", (0, 0))
        total += _held(scheme, n * k, k) - (0 if head else n * k * 4)
    return total


def _held(scheme: str, numel: int, k: int | None) -> int:
    """Bytes ``numel`` weights take under ``scheme``: in ``format_for(scheme, k)`` when ``k`` is given and fits
    one, else float32."""
    from swarm.kernels.qblocks import FORMATS, format_for

    fmt = format_for(scheme, k) if k else None
    return numel // FORMATS[fmt].block * FORMATS[fmt].block_bytes if fmt else numel * 4


def _expert_k(name: str, shape, model_type: str) -> int | None:
    """The input width K of a routed expert's matrix as :func:`quantize_experts` holds it, or None for another
    tensor: a fused (E, N, K) ``experts.gate_up_proj`` / ``experts.down_proj`` ((E, K, N) in gpt-oss), or one
    expert's (N, K) ``experts.E.w1|w2|w3|*_proj.weight`` (stacked into those at load)."""
    if ".experts." not in name:
        return None
    if len(shape) == 3 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return shape[1] if model_type == "gpt_oss" else shape[2]
    if len(shape) == 2 and name.endswith((".w1.weight", ".w2.weight", ".w3.weight", "_proj.weight")):
        return shape[1]
    return None


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _gguf_tensors(model_dir: Path, config, layer_range, head: bool, tail: bool) -> dict:
    from swarm.model.gguf_tensors import read_layer_tensors
    from swarm.model.resolve import gguf_source

    source = gguf_source(model_dir)
    if source is None:
        raise ConfigError(f"--quantize gguf holds the blocks of the GGUF file a model came from, and {model_dir} is no "
                          "conversion of a GGUF file that exists: give --model the .gguf file or a built-in name "
                          "(smollm2-135m); a float checkpoint takes --quantize " + ", ".join(QUANTIZED_AT_LOAD))
    return read_layer_tensors(source, config, layer_range, head=head, tail=tail)
