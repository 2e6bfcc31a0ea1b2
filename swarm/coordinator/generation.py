"""``generate``: one ``swarm coordinate`` run from prompt text to the result record ``--json`` prints.

Owns: tokenizing the prompt (chat template, a kept conversation), the stop ids, connecting (``routing``),
decoding (``decoding``), streaming text and the job's receipt (``jobs``). Holds no layers of the target model:
only the tokenizer (and a draft model, if asked).
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import trio

from swarm import receipts
from swarm.config import CoordinatorConfig, cache_root
from swarm.errors import ConfigError, ModelError
from swarm.coordinator.text import Detokenizer
from swarm.coordinator.decoding import DecodeOptions, decode
from swarm.coordinator.jobs import check_receipt_dir, offer_for_audit, write_job_receipt
from swarm.coordinator.routing import connect_ring, swarm_may_serve

log = logging.getLogger(__name__)


def eos_ids(model_dir, tokenizer) -> set[int]:
    """The end-of-sequence ids transformers' generate would stop at (generation_config first)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        p = Path(model_dir) / name
        if p.is_file():
            val = json.loads(p.read_text()).get("eos_token_id")
            if val is not None:
                ids.update(val if isinstance(val, list) else [val])
                break
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def vocab_size(model_dir) -> int:
    """The target model's vocabulary size V, from ``model_dir``'s config.json (``vocab_size`` or ``n_vocab``)."""
    data = json.loads((Path(model_dir) / "config.json").read_text())
    return int(data.get("vocab_size") or data.get("n_vocab"))


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``, always literal text (control tokens typed into it, such as ``<s>``,
    stay text; the tokenizer adds its own BOS); with ``chat`` the tokenizer's chat template and a
    generation prompt (see ``swarm.coordinator.chat``)."""
    if chat:
        from swarm.coordinator.chat import encode_chat_flag

        return encode_chat_flag(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt, split_special_tokens=True)["input_ids"])  # a typed "<s>" stays text


async def generate(config: CoordinatorConfig, prompt: str, on_text=None, on_ids=None) -> dict:
    """Run one greedy generation around the ring and return the result record.

    Args:
        config: the coordinator config (ring, limits, timeouts).
        prompt: user text; with ``config.chat`` wrapped in the chat template.
        on_text: called with each newly decoded piece of text as tokens are committed.
        on_ids: called with all new ids after each commit (e.g. the demo's stage killer).
    Returns:
        dict with text, prompt_ids, output_ids, new_tokens, tokens_per_s (decode), ttft_s, total_s,
        ring (index, peer_id, addr, layers), model.
    Raises:
        ConfigError, StageLost, HopTimeout, RemoteError, ContextOverflow-like RemoteError.
    """
    from transformers import AutoTokenizer

    from swarm.coordinator.drafters import make_drafter
    from swarm.model.block import model_num_layers
    from swarm.model.resolve import model_manifest_digest, resolve_model
    from swarm.transport import open_host
    from swarm.transport.identity import claim_key

    if config.bootstrap:  # before converting or downloading the model: does the swarm serve it at all?
        await swarm_may_serve(config.ring.model, config.bootstrap)
    resolved = resolve_model(config.ring.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer of {resolved.path}: {str(exc).splitlines()[0]}") from exc
    num_layers = model_num_layers(resolved.path)
    digest = model_manifest_digest(resolved.path)
    prompt_ids, conversation = _prompt_ids(config, resolved.name, digest, tokenizer, prompt)
    stop = eos_ids(resolved.path, tokenizer)
    drafter = make_drafter(config.spec.draft, target_vocab=vocab_size(resolved.path), sampling=config.sampling)
    # the default key is anyone's: a second coordinator (or `swarm serve`) running beside takes the next slot
    key, _ = claim_key(config.key_path or cache_root() / "keys" / "coordinator.key", fallback=config.key_path is None)
    job = None
    if config.receipt_dir is not None:  # checked before any work, so a finished job always gets its receipt
        check_receipt_dir(config.receipt_dir)
        job = {"id": uuid.uuid4().hex, "nonce": receipts.new_nonce()}

    async with open_host(key, ["/ip4/127.0.0.1/tcp/0"]) as host, trio.open_nursery() as nursery:
        ring, route_s = await connect_ring(config, host, nursery, resolved.path, num_layers, len(prompt_ids), digest)
        # a completion continues the prompt's text: decoded after it (a SentencePiece word keeps its space)
        stream = Detokenizer(tokenizer, context=() if config.chat else prompt_ids)
        hooks = [h for h in (on_ids, (lambda ids: on_text(stream.update(ids))) if on_text else None) if h]
        on_ids = (lambda ids: [h(ids) for h in hooks]) if hooks else None
        options = DecodeOptions(config.max_new_tokens, stop, config.spec, drafter, config.sampling, config.wire_dtype,
                                heal=config.heal, job=job, shadow=config.shadow, prefix_cache=config.prefix_cache)
        decoded = await decode(ring, prompt_ids, options, on_ids=on_ids)
        if ring.discovery is not None:  # routed by the swarm: the next route prefers what this session measured
            from swarm.coordinator.measured import note_session

            note_session(ring.discovery.model_id, [(i.peer_id, tuple(i.layers)) for i in ring.infos],
                         ring.discovery.client_rtt_ms,
                         decoded)
        out, timing = decoded.output_ids, decoded.as_record()
        tail = stream.update(out, final=True)
        if on_text:
            on_text(tail)
        infos = ring.infos  # after any heal: the ring that finished the job
        ring_entries = [i.entry() for i in infos]
        parts = timing.pop("receipt_parts", None)
        receipt = None
        if job is not None:  # signed, then offered to auditor-role stages while the host is still up
            receipt = write_job_receipt(config.receipt_dir, key, job, parts, model=resolved.name,
                                        model_digest=digest, num_layers=num_layers, prompt_ids=prompt_ids,
                                        output_ids=out, ring=ring_entries, record=timing)
            await offer_for_audit(host, receipt, ring.discovery, config.ring.spares)
        nursery.cancel_scope.cancel()
    result = {
        "text": stream.text,
        "prompt_ids": prompt_ids,
        "output_ids": out,
        "new_tokens": len(out),
        **timing,
        "ring": ring_entries,
        "model": resolved.name,
    }
    if route_s is not None:
        result["route_s"] = round(route_s, 3)
    if conversation is not None:
        conversation.record(prompt, prompt_ids, out, result["text"])
        result["session_file"] = str(conversation.path)
    if receipt is not None:
        result["receipt"] = receipt
    return result


def _prompt_ids(config: CoordinatorConfig, model_name: str, digest: str, tokenizer,
                prompt: str) -> tuple[list[int], object]:
    """The prompt's token ids for ``generate``, and the conversation it continues (``--session``) or None.

    Raises:
        ConfigError: the prompt is empty after tokenization (or see ``encode_prompt``, ``Conversation.open``).
    """
    conversation = None
    if config.session_file is not None:
        from swarm.coordinator.conversation import Conversation

        conversation = Conversation.open(config.session_file, model=model_name, model_digest=digest,
                                         chat=config.chat)
        prompt_ids = conversation.prompt_ids(tokenizer, prompt)
    else:
        prompt_ids = encode_prompt(tokenizer, prompt, config.chat)
    if not prompt_ids:
        raise ConfigError("the prompt is empty after tokenization")
    return prompt_ids, conversation


