"""``Server``: continuous batching of many prompts over one numbakv cache and an attached model.

Each :meth:`Server.step` is one forward pass of the attached model over a packed batch mixing
prompt chunks and decode tokens; finished requests free their sequence. With a prefix store
(``Server(model, cache, store=store)``) a request first loads the longest prefix of its prompt
the store holds (its prefill starts after it) and a finished or cancelled request saves what its
sequence holds, so later prompts sharing a prefix skip that part of their prefill.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional

import numpy as np

from ..errors import KVCacheError, KVCacheFullError, NotSupportedError
from ._deps import _transformers
from .attach import attach, attached_cache
from .identity import check_store_model


class Server:
    """Continuous batching over one numbakv cache (``hf.cache_for``'s) and an attached model.

    ``submit`` queues a prompt; every ``step`` runs ONE forward pass of the model over a packed
    batch holding one decode token of every running request and, in the room left (the cache's
    ``max_batch``), chunks of waiting prompts; it returns the token each request produced.
    A request that reached ``max_new_tokens`` (or its ``eos_token_id``) is moved to
    ``finished`` and its sequence freed. Greedy by default; ``do_sample=True`` with
    ``temperature``/``top_k`` samples from a per-request ``torch.Generator(seed)``.

        srv = hf.Server(model, hf.cache_for(model, capacity=1024, max_seqs=4))
        rids = [srv.submit(p, max_new_tokens=16) for p in prompts]
        while srv.pending:
            srv.step()
        outputs = [srv.finished[r] for r in rids]

    ``store``: a ``numbakv.PrefixStore`` of ``cache`` (its ``retain_seqs`` are never given to
    requests; a store that records a ``model_id`` must record :func:`numbakv.hf.model_id` of
    ``model``). A request's prompt then starts from the store's longest prefix (the first
    time it is scheduled) and a finished or cancelled request saves its tokens. ``stats``
    counts prompt tokens computed and reused.

    ``edit_reuse=True`` (off by default: an approximation): a prompt that differs from a stored
    one only inside a range (an agent stripped earlier reasoning) loads with
    ``store.load_edit``: the stored suffix after the edit is moved to its new positions and the
    server computes only the ranges it returns (the edit plus ``recompute_after`` tokens after
    it) before prefilling on; the rest of the suffix keeps K/V computed before the edit, so
    outputs may differ from a full prefill (see ``PrefixStore.match_edit``).
    """

    def __init__(self, model: Any, cache: Any, *, prefill_chunk: int = 256,
                 store: Any = None, edit_reuse: bool = False,
                 recompute_after: int = 16) -> None:
        torch, _ = _transformers()
        self._torch = torch
        if store is not None:
            if not all(callable(getattr(store, n, None)) for n in ("match", "load", "save")) \
                    or not hasattr(store, "retain_seqs"):
                raise ValueError(f"store must be a numbakv.PrefixStore or None, got "
                                 f"{type(store).__name__}")
            if getattr(store, "cache", None) is not cache:
                raise ValueError("store must be a PrefixStore of this cache "
                                 "(PrefixStore(cache, ...))")
            check_store_model(store, model, "hf.Server")
        if attached_cache(model) is None:
            attach(model, cache)
        elif attached_cache(model) is not cache:
            raise ValueError("model is attached to another cache: hf.detach(model) first")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) \
                or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        if not isinstance(edit_reuse, bool):
            raise ValueError(f"edit_reuse must be a bool, got {edit_reuse!r}")
        if edit_reuse and store is None:
            raise ValueError("edit_reuse=True needs a store (Server(..., store=PrefixStore(...)))")
        if edit_reuse and getattr(cache, "rc", None) is not None:
            raise NotSupportedError("edit_reuse=True: a hybrid model's recurrent state after an "
                                    "edit depends on every token before it (nothing after the "
                                    "edit can be re-used)")
        if isinstance(recompute_after, bool) or not isinstance(recompute_after, int) \
                or recompute_after < 0:
            raise ValueError(f"recompute_after must be an integer >= 0, got {recompute_after!r}")
        self.edit_reuse, self.recompute_after = edit_reuse, recompute_after
        self.model, self.cache, self.prefill_chunk = model, cache, prefill_chunk
        attn = getattr(cache, "attn", cache)        # a HybridCache's attention half
        cfg = getattr(attn, "config", None) or attn.caches[0].config
        self._max_batch = cfg.max_batch
        self.store = store
        reserved = set(store.retain_seqs) if store is not None else set()
        self._free = [s for s in range(cfg.max_seqs) if s not in reserved]
        #: prompt tokens computed by the model, and taken from the store instead
        self.stats: Dict[str, int] = {"prefill_tokens": 0, "reused_tokens": 0}
        self._ids = itertools.count()
        self._device = next(model.parameters()).device
        self._waiting: List[int] = []
        self._reqs: Dict[int, dict] = {}
        self.finished: Dict[int, List[int]] = {}
        self._last_batch = 0

    @property
    def pending(self) -> int:
        """Requests submitted and not finished."""
        return len(self._reqs)

    def submit(self, prompt_ids: Any, max_new_tokens: int = 32, *, do_sample: bool = False,
               temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0,
               eos_token_id: Optional[int] = None, priority: Optional[int] = None,
               ttl: Optional[float] = None) -> int:
        """Queue ``prompt_ids`` (a sequence of token ids, ``[n]``); returns the request id.
        ``priority`` (0..100) / ``ttl`` (seconds): the retention its tokens get in the store
        when it finishes or is cancelled (``PrefixStore.save(priority=, ttl=)``; an agent
        runtime gives a live session's turns a high priority); None: the store's default."""
        if (priority is not None or ttl is not None) and self.store is None:
            raise ValueError("priority/ttl need a store (Server(..., store=PrefixStore(...)))")
        if priority is not None and (isinstance(priority, bool) or not isinstance(
                priority, (int, np.integer)) or not 0 <= priority <= 100):
            raise ValueError(f"priority must be an integer in [0, 100] or None, got {priority!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(
                ttl, (int, float, np.integer, np.floating)) or not ttl >= 0):
            raise ValueError(f"ttl must be seconds >= 0 or None, got {ttl!r}")
        ids = np.asarray(prompt_ids.detach().cpu() if hasattr(prompt_ids, "detach")
                         else prompt_ids).reshape(-1)
        if ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt_ids must be a non-empty sequence of token ids, got "
                             f"{ids.dtype} [{ids.size}]")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        rid = next(self._ids)
        gen = None
        if do_sample:
            gen = self._torch.Generator(device=self._device).manual_seed(int(seed))
        self._reqs[rid] = {"prompt": ids.astype(np.int64).tolist(), "done": 0, "seq": None,
                           "out": [], "max": max_new_tokens, "sample": do_sample,
                           "temp": float(temperature), "top_k": top_k, "gen": gen,
                           "eos": eos_token_id, "gaps": [], "priority": priority,
                           "ttl": ttl}
        self._waiting.append(rid)
        return rid

    def step(self) -> Dict[int, int]:
        """One forward pass: ``{request id: new token id}`` for the requests that produced a
        token (decodes, and prompts whose last chunk ran). The batch is planned first and the
        server's state changes only after the pass ran: a pass that raises (the cache full, the
        model failing) leaves the requests as they were and the cache without its tokens."""
        torch = self._torch
        if self.store is not None:
            self._load_prefixes()
        tokens: List[int] = []
        positions: List[int] = []
        seqs: List[int] = []
        last_row: Dict[int, int] = {}
        placed: Dict[int, int] = {}                # sequence -> first position this pass puts
        chunks: List[tuple] = []                   # (rid, seq, tokens taken)
        gaps: Dict[int, tuple] = {}                # sequence -> the gap range this pass fills
        free = list(self._free)
        room = self._max_batch
        for rid, r in self._reqs.items():          # one decode token per running request
            if r["seq"] is not None and r["done"] == len(r["prompt"]) and room > 0:
                p = len(r["prompt"]) + len(r["out"]) - 1
                tokens.append(r["out"][-1])
                positions.append(p)
                seqs.append(r["seq"])
                placed[r["seq"]] = p
                last_row[rid] = len(tokens) - 1
                room -= 1
        for rid in self._waiting:                  # then prompt chunks in the room left
            r = self._reqs[rid]
            if room <= 0:
                break
            seq = r["seq"]
            if seq is None:
                if not free:
                    break
                seq = free.pop(0)
            if r["gaps"]:                          # ranges an edited load left to compute
                a, b = r["gaps"][0]
                n = min(self.prefill_chunk, room, b - a)
                tokens += r["prompt"][a:a + n]
                positions += range(a, a + n)
                seqs += [seq] * n
                gaps[seq] = (a, a + n)
                chunks.append((rid, seq, n))
                room -= n
                continue
            n = min(self.prefill_chunk, room, len(r["prompt"]) - r["done"])
            tokens += r["prompt"][r["done"]:r["done"] + n]
            positions += range(r["done"], r["done"] + n)
            seqs += [seq] * n
            placed[seq] = r["done"]
            chunks.append((rid, seq, n))
            room -= n
            if r["done"] + n == len(r["prompt"]):
                last_row[rid] = len(tokens) - 1
        self._last_batch = len(tokens)
        if not tokens:
            return {}
        self.cache.start_forward(positions, seqs)
        try:
            ids = torch.tensor([tokens], device=self._device)
            pos = torch.tensor([positions], device=self._device)
            with torch.no_grad():
                logits = self.model(input_ids=ids, position_ids=pos).logits[0]
            picks = {rid: self._pick(logits[row].float(), self._reqs[rid])
                     for rid, row in last_row.items()}
        except BaseException:
            for seq, p0 in placed.items():         # the tokens of the failed pass go again
                try:
                    self.cache.remove(seq, p0)
                except (ValueError, NotSupportedError):
                    self._restart(seq)
            for seq, (a, b) in gaps.items():       # (inside a gap: that range only)
                self.cache.seq_rm(seq, a, b)
            raise
        self._free = free
        for rid, seq, n in chunks:
            r = self._reqs[rid]
            r["seq"] = seq
            self.stats["prefill_tokens"] += n
            if seq in gaps:
                a, b = r["gaps"][0]
                r["gaps"][0] = (a + n, b)
                if a + n == b:
                    r["gaps"].pop(0)
                continue
            r["done"] += n
            if r["done"] == len(r["prompt"]):
                self._waiting.remove(rid)
        new: Dict[int, int] = {}
        for rid, tok in picks.items():
            r = self._reqs[rid]
            r["out"].append(tok)
            new[rid] = tok
            if len(r["out"]) >= r["max"] or (r["eos"] is not None and tok == r["eos"]):
                self._release(rid)
                self.finished[rid] = r["out"]
        return new

    def _restart(self, seq: int) -> None:
        """A hybrid model's failed pass: the recurrent state of ``seq`` cannot go back to where
        the pass began (no restore point there; the layers that ran updated it in place), so
        its request starts over from its prompt (the tokens it produced are produced again)."""
        self.cache.remove(seq, 0)
        for rid, r in self._reqs.items():
            if r["seq"] == seq:
                r["done"], r["out"] = 0, []
                if rid not in self._waiting:
                    self._waiting.append(rid)

    def _load_prefixes(self) -> None:
        """Give each waiting request that has no sequence yet (while sequences are free) its
        sequence, holding the store's longest prefix of its prompt (keeping one token to
        compute: its logits pick the first new token)."""
        for rid in self._waiting:
            r = self._reqs[rid]
            if r["seq"] is not None:
                continue
            if not self._free:
                break
            seq = self._free.pop(0)
            gaps: list = []
            try:
                if self.edit_reuse:
                    n = self.store.load_edit(seq, r["prompt"][:-1],
                                             recompute_after=self.recompute_after)
                    gaps = [g for g in self.store.last_recompute if g[1] > g[0]]
                    done = self.store.last_edit.end
                else:
                    n = done = self.store.load(seq, r["prompt"][:-1])
            except KVCacheFullError:
                n = done = 0                       # no room to promote it: compute the prompt
            r["seq"], r["done"], r["gaps"] = seq, done, gaps
            self.stats["reused_tokens"] += n

    def _release(self, rid: int) -> None:
        """Save what request ``rid``'s sequence holds to the store (if any), free it, forget
        the request."""
        r = self._reqs.pop(rid)
        seq = r["seq"]
        if seq is None:
            return
        if self.store is not None:
            # an edited load's gaps not yet computed: only what lies before the first is whole
            held = r["prompt"][:r["gaps"][0][0] if r["gaps"] else r["done"]]
            if r["done"] == len(r["prompt"]) and r["out"]:
                held = r["prompt"] + r["out"][:-1]     # the last token was never computed
            if held:
                self.store.save(seq, held, priority=r["priority"], ttl=r["ttl"])
        self.cache.remove(seq, 0)
        self._free.append(seq)

    def cancel(self, rid: int) -> List[int]:
        """Stop request ``rid`` (waiting or running): its sequence is saved to the store (when
        the server has one) and freed. Returns the tokens it generated so far (they are not
        added to ``finished``). Raises ``ValueError`` for an unknown or finished request."""
        if isinstance(rid, bool) or not isinstance(rid, int) or rid not in self._reqs:
            raise ValueError(f"rid must be the id of a pending request, got {rid!r}")
        out = self._reqs[rid]["out"]
        if rid in self._waiting:
            self._waiting.remove(rid)
        self._release(rid)
        return out

    def _pick(self, logits, r: dict) -> int:
        torch = self._torch
        if not r["sample"]:
            return int(torch.argmax(logits))
        logits = logits / r["temp"]
        if r["top_k"]:
            kth = torch.topk(logits, int(r["top_k"])).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=r["gen"]))

    def run(self) -> Dict[int, List[int]]:
        """Step until every submitted request finished; returns ``finished``."""
        while self._reqs:
            self.step()
            if not self._last_batch:
                raise KVCacheError("no request can make progress: no free sequence and no "
                                   "room in max_batch")
        return self.finished
