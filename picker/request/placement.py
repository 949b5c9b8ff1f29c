"""Cache-aware placement for the request path: a request's cache keys, the pick, and what is learned.

The request path (picker/request/pipeline.py) calls this at four moments:
- `keys` at admission: the request's chained block keys (approximate: its prompt material in
  pseudo-token blocks; precise: the engine's token ids in engine blocks), its size, model, session;
- `choose` at dispatch: the request as the pick sees it (`Ask`), one row per READY candidate
  (picker/scheduling/rows.py: load, cached share, LoRA, session, predictions), then the choice over
  the rows (filters, scorers: picker/scheduling/choice.py); None when there is nothing to weigh,
  and the plain load pick applies;
- `dispatched` / `served`: the endpoint that takes the request learns its blocks (approximate),
  its session binds there;
- `ended`: the engine's own report of what it had cached (`usage.prompt_tokens_details`) corrects
  the approximate index of the endpoint that served.
Approximate block size: `affinity.block_tokens` pseudo-tokens, raised to the engines' block size
when they publish a larger one (`vllm:cache_config_info`); the indexes are emptied when it changes.
No I/O: token ids for precise keys come from the frontend (an engine's /tokenize).
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence

from picker.config.model import AffinityConfig
from picker.contract import Outcome
from picker.observability.metrics import Metrics
from picker.pool import Endpoint, Pool
from picker.pool.cache import CacheKeys, PrefixIndex
from picker.pool.sessions import Sessions
from picker.request import index_size
from picker.request.inference import InferenceRequest
from picker.scheduling import LoadPolicy, Stagger, rows
from picker.scheduling.choice import AffinityPolicy, Choice, choose
from picker.scheduling.latency import LatencyModel
from picker.scheduling.load import measure
from picker.scheduling.prefix import prompt_blocks, seed_of, token_blocks
from picker.scheduling.rows import Ask, output_tokens, steer
from picker.scheduling.uniformity import Uniformity
from picker.streams import RequestRecord
from picker.streams.record import Slo

log = logging.getLogger(__name__)

# a critical request's SLO guards the sheddable work admitted after it for this long (seconds)
GUARD_S = 10.0


class Placement:
    def __init__(
        self, pool: Pool, config: AffinityConfig, metrics: Metrics, sessions: Sessions | None
    ) -> None:
        self._pool = pool
        self._config = config
        self._metrics = metrics
        self.sessions = sessions
        self.policy = AffinityPolicy.of(config)
        # a pick with nothing to steer by (no scale-down ranks, or a short request) scores without
        # the scale-down scorer: kube.deletion_cost off costs nothing here
        self._unsteered = dataclasses.replace(self.policy, scale_down_weight=0.0)
        self.block_tokens = config.block_tokens
        # affinity.latency: each replica's TTFT and time per output token, learned online (on and auto);
        # the pick uses its predictions while `engaged` (on: always; auto: while the pool is not uniform)
        self.latency = LatencyModel(config.latency_half_life_s) if config.latency != "off" else None
        self.engaged = config.latency == "on"
        if self.latency is not None:
            self.latency.eager = self.engaged  # auto: fitted after scrapes until it engages
        self.uniformity = (
            Uniformity(
                config.latency_engage_ratio,
                config.latency_release_ratio,
                config.latency_engage_after_s,
                config.latency_release_after_s,
            )
            if config.latency == "auto"
            else None
        )
        metrics.set_latency_engaged(self.engaged)
        self._refreshed_at = float("-inf")
        self._routings = 0  # the indexes' clock: prompts routed so far (PrefixIndex.routed_at)
        self.tokens = index_size.TokenRatio()  # approximate: the engines' tokens per pseudo-token
        self._engine_slots: int | None = None  # load.engine_slots, as the picks are given it
        # the latest critical request's SLO, and when it came: sheddable work gives way to it
        self._guarded: tuple[Slo, float] | None = None
        pool.on_forget(self._forgotten)

    @property
    def mode(self) -> str:
        return self._config.prefix

    def keys(
        self, request: InferenceRequest, session: str | None, tokens: Sequence[int] | None
    ) -> CacheKeys | None:
        """What the request looks up in caches; None when there is nothing to look up."""
        config = self._config
        if config.prefix == "off" and session is None:
            return None
        seed = seed_of(request.model, request.cache_salt)
        blocks: tuple[int, ...] = ()
        token_keys: tuple[int, ...] = ()
        if config.prefix == "approximate" and request.prompt:
            block_bytes = self.block_tokens * config.bytes_per_token
            blocks = prompt_blocks(request.prompt, block_bytes, seed, config.max_blocks)
        elif config.prefix == "precise" and tokens:
            block_size = self._kv_block_size()
            if block_size:
                token_keys = token_blocks(tokens[: block_size * config.max_blocks], block_size, seed)
        estimated = len(tokens) if tokens else len(request.prompt) // config.bytes_per_token
        return CacheKeys(blocks, token_keys, estimated, request.model, session, self.block_tokens)

    def bound_endpoint(self, record: RequestRecord) -> str | None:
        """The endpoint the request's session is bound to (affinity.session_header), if any."""
        keys = record.keys
        if keys is None or keys.session is None or self.sessions is None:
            return None
        return self.sessions.endpoint(keys.session)

    def choose(
        self,
        record: RequestRecord,
        candidates: Sequence[Endpoint],
        count: int,
        rng: random.Random,
        now: float,
        load: LoadPolicy,
        suspects: frozenset[str],
        stagger: Stagger | None = None,
        ahead: int = 0,
    ) -> Choice | None:
        """The affinity pick, or None when nothing but load tells the candidates apart. `ahead`:
        the requests waiting in the picker ahead of this one. One way: the request as the pick sees
        it, one row per candidate (picker/scheduling/rows.py), then the choice over the rows
        (filters, scorers: picker/scheduling/choice.py)."""
        keys = record.keys
        model = record.model  # an adapter some candidate runs or queues: LoRA affinity applies
        lora = any(model in c.running_adapters or model in c.waiting_adapters for c in candidates)
        latency = self.latency if self.engaged else None
        self._engine_slots = load.engine_slots
        ranked = self._pool.scale_down  # kube.deletion_cost: where each pod stands in a scale-down
        steers = steer(record.max_tokens, ranked.steer_tokens) if ranked and ranked.next_to_go else 0.0
        if keys is None and not lora and latency is None and not steers:
            return None
        slo = record.slo
        ask = Ask(
            keys,
            model,
            lora,
            self.bound_endpoint(record),
            output_tokens(record.max_tokens),
            None if slo is None else (slo.ttft_s, slo.tpot_s),
            steers,
        )
        window = self._config.balance_window_s
        table = rows.build(
            candidates,
            ask,
            now,
            load,
            rng,
            suspects=suspects,
            stagger=stagger,
            window_s=window,
            latency=latency,
            next_to_go=ranked.next_to_go if ranked is not None and steers else None,
        )
        choice = choose(table, count, self.policy if steers else self._unsteered, ask.slo, ahead)
        waits = choice.reason == "wait"
        if waits and not record.waits_for_quicker:
            self._metrics.count_latency_wait()
        record.waits_for_quicker = waits
        found = choice.primary
        if choice.destinations and found is not None:
            if found.ttft_x is not None:
                record.ttft_x, record.tpot_x = found.ttft_x, found.tpot_x
                record.predicted_ttft, record.dispatched_at = found.ttft_s, now
            elif self.latency is not None:  # auto, not engaged: the model learns from the primary alone
                uncached = ask.size * (1.0 - found.cached)
                self.learns_from(record, found.address, found.load, uncached, load, now)
            if keys is not None and keys.blocks:
                record.predicted_blocks = round(found.cached * len(keys.blocks))
            record.prefill = ask.size * (1.0 - found.cached)
            if keys is not None or lora or latency is not None:  # not a pick the steer alone made
                self._metrics.count_placement(choice.reason, found.cached)
        return choice

    def learns_from(
        self,
        record: RequestRecord,
        address: str,
        current: float | None,
        uncached: float | None,
        load: LoadPolicy,
        now: float,
    ) -> None:
        """The latency model will learn from this request on `address` (picked without predictions:
        `auto` not engaged): its features there, computed for it alone. `current`, `uncached`: the
        endpoint's load and the request's uncached prompt tokens there, when the pick knew them."""
        endpoint = self._pool.get(address)
        if self.latency is None or endpoint is None:
            return
        if current is None:
            current = measure(endpoint, now, load)[2]
        if uncached is None:
            keys = record.keys
            size = keys.estimated_tokens if keys is not None else 0
            uncached = size * (1.0 - (keys.cached_fraction(endpoint) if keys is not None else 0.0))
        latency = self.latency
        ttft_s, _, record.ttft_x, record.tpot_x = rows.predict(latency, endpoint, current, uncached, load)
        record.predicted_ttft, record.dispatched_at = ttft_s, now

    def dispatched(self, record: RequestRecord, address: str) -> None:
        """`address` takes the request (its primary, or the fallback that served it)."""
        keys = record.keys
        if keys is None:
            return
        self.prefilled(record)  # a fallback that served it carries its backlog now
        # a pair's prefill replica computes the prompt, and both replicas hold it afterwards
        computes = self._pool.get(record.prefill_on or address)
        if computes is not None and record.prefill:
            computes.pending_prefill += record.prefill
            record.prefill_at = computes.address
        # keys cut before the block size changed (tune) stay out of the indexes cut at the new one
        fresh = keys.blocks and keys.block_tokens == self.block_tokens
        holders = (computes, self._pool.get(address)) if record.prefill_on else (computes, None)
        for endpoint in holders if fresh else ():
            if endpoint is None:
                continue
            if endpoint.prefix is None:
                capacity = index_size.capacity(
                    endpoint, self.block_tokens, self.tokens.value, self._config.index_blocks
                )
                endpoint.prefix = PrefixIndex(capacity)
            self._routings += 1
            endpoint.prefix.add(keys.blocks, self._routings)
        if keys.session is not None and self.sessions is not None:
            self.sessions.bind(keys.session, address)

    def shed(self, record: RequestRecord, pool: Pool, load: LoadPolicy, now: float) -> Outcome | None:
        """Whether a request is refused for latency, and why (with the latency model only).

        A sheddable request with an SLO that no ready replica is predicted to meet now:
        `rejected-slo-unattainable`. Critical requests are never refused, so at overload their
        objectives hold only if the sheddable work gives way: a sheddable request without an SLO of
        its own is held to the latest critical request's (seen within `GUARD_S`), and refused as
        `rejected-saturated` when no replica is predicted to meet that."""
        if not self.engaged:
            return None
        if record.priority >= 0:
            if record.slo is not None:
                self._guarded = (record.slo, now)
            return None
        if record.slo is not None:
            if self.attainable(record, pool.ready(), load, now):
                return None
            self._metrics.count_slo(record.slo, "refused")
            return Outcome.REJECTED_SLO_UNATTAINABLE
        guarded = self._guarded
        if guarded is None or now - guarded[1] > GUARD_S:
            return None
        if self.attainable(record, pool.ready(), load, now, guarded[0]):
            return None
        return Outcome.REJECTED_SATURATED

    def attainable(
        self,
        record: RequestRecord,
        candidates: Sequence[Endpoint],
        load: LoadPolicy,
        now: float,
        slo: Slo | None = None,
    ) -> bool:
        """Whether some candidate with room is predicted to meet `slo` (the request's own by default)
        now (True without one). With none, it would wait in the queue behind what is queued already:
        not in time."""
        slo, latency = slo or record.slo, self.latency
        if slo is None or latency is None or not self.engaged:
            return True
        keys = record.keys
        size = keys.estimated_tokens if keys is not None else 0
        for c in candidates:
            full, _, current = measure(c, now, load)
            if full:
                continue
            cached = keys.cached_fraction(c) if keys is not None else 0.0
            ttft_s, tpot_s, _, _ = rows.predict(latency, c, current, size * (1.0 - cached), load)
            if slo.met_by(ttft_s, tpot_s):
                return True
        return False

    def first_token(self, record: RequestRecord) -> None:
        """Its first token came: its prompt leaves the backlog, and the model learns its TTFT."""
        if record.prefill_at is not None:
            self.prefilled(record)
        tracker, latency, x = record.tracker, self.latency, record.ttft_x
        if latency is None or x is None or tracker is None or tracker.first_byte_at is None:
            return
        record.ttft_x = None  # learned once
        if record.dispatched_at is None or not record.picked or record.endpoint != record.picked[0]:
            return  # a fallback served it: the features were its primary's
        ttft = tracker.first_byte_at - record.dispatched_at
        latency.learn_ttft(record.picked[0], x, ttft, tracker.first_byte_at)
        self._metrics.observe_latency_prediction(
            record.picked[0], "ttft", record.predicted_ttft, ttft, record.slo
        )
        if tracker.first_byte_at - self._refreshed_at >= 1.0:  # no scrape came to do it (load.scrape off)
            self.tune()

    def prefilled(self, record: RequestRecord) -> None:
        """Its first token came (or it ended): its prompt no longer waits in its endpoint's prefill."""
        address, record.prefill_at = record.prefill_at, None
        endpoint = self._pool.get(address) if address is not None else None
        if endpoint is not None:
            endpoint.pending_prefill = max(0.0, endpoint.pending_prefill - record.prefill)

    def ended(self, record: RequestRecord) -> None:
        """It completed: the model learns its time per output token; the engine said how large the
        prompt was and how much of it it had cached: the approximate index learns both."""
        self._learn_tpot(record)
        keys, tracker = record.keys, record.tracker
        if keys is None or not keys.blocks or tracker is None:
            return
        prompt = tracker.usage_prompt_tokens
        if prompt and keys.estimated_tokens and self._config.engine_feedback:
            self.tokens.add(prompt, keys.estimated_tokens)
        if tracker.usage_cached_tokens is None or not self._config.engine_feedback:
            return
        if not prompt or not record.picked or record.endpoint != record.picked[0]:
            return
        endpoint = self._pool.get(record.endpoint)
        if endpoint is None or endpoint.prefix is None:
            return
        cached_blocks = int(tracker.usage_cached_tokens / prompt * len(keys.blocks))
        # blocks differ in size between the picker and the engine: one block short is noise
        endpoint.prefix.observed(record.predicted_blocks - 1, cached_blocks)
        self._metrics.count_prefix_feedback(
            record.predicted_blocks * self.block_tokens, tracker.usage_cached_tokens
        )

    def _learn_tpot(self, record: RequestRecord) -> None:
        tracker, latency, x = record.tracker, self.latency, record.tpot_x
        if latency is None or x is None or tracker is None or not record.picked:
            return
        first, last, tokens = tracker.first_byte_at, tracker.last_chunk_at, tracker.tokens
        if first is None or last is None or tokens < 2 or record.endpoint != record.picked[0]:
            return
        tpot = (last - first) / (tokens - 1)
        predicted = latency.tpot(record.picked[0], x)
        latency.learn_tpot(record.picked[0], x, tpot, last, tokens)
        self._metrics.observe_latency_prediction(record.picked[0], "tpot", predicted, tpot, record.slo)

    def tune(self) -> None:
        """After a scrape: let the latency model's old observations fade (at most once a second),
        and raise the block size to the engines' when they publish a larger one."""
        now = self._pool.now()
        if self.latency is not None and now - self._refreshed_at >= 1.0:
            self._refreshed_at = now
            self.latency.refresh(now)
            self._judge(now)
        index_size.follow(self._pool.endpoints(), self.block_tokens, self.tokens.value)
        published = max((e.block_size or 0 for e in self._pool.endpoints()), default=0)
        wanted = max(self._config.block_tokens, published)
        if self._config.prefix != "approximate" or wanted == self.block_tokens:
            return
        log.info("prefix affinity block_tokens=%d (the engines' block size)", wanted)
        self.block_tokens = wanted
        for endpoint in self._pool.endpoints():
            endpoint.prefix = None  # keyed by the old block size: useless now

    def _judge(self, now: float) -> None:
        """auto: whether the pool is uniform (picker/scheduling/uniformity.py); a switch is logged once."""
        if self.uniformity is None or self.latency is None:
            return
        ready = self._pool.ready()
        configured = self._engine_slots
        slots = {e.address: float(configured or e.learned_slots) for e in ready}
        switched = self.uniformity.judge(self.latency, now, slots, {e.address for e in ready})
        measured = self.uniformity.last_spread
        if switched:
            self.engaged = self.latency.eager = self.uniformity.engaged
            log.info(
                "affinity.latency auto: %s (the slower replicas' predicted time %.2f x the quicker ones')",
                "engaged: the pool is not uniform" if self.engaged else "released: the pool is uniform",
                measured or 0.0,
            )
        self._metrics.set_latency_engaged(self.engaged, measured)

    def _kv_block_size(self) -> int | None:
        for endpoint in self._pool.ready():
            if endpoint.kv is not None and endpoint.kv.block_size:
                return endpoint.kv.block_size
        return None

    def _forgotten(self, address: str) -> None:
        if self.latency is not None:
            self.latency.forget(address)
        if self.sessions is not None:
            self.sessions.forget_endpoint(address)
