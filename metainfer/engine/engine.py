"""The engine: validation, the step loop (schedule -> run -> update), stop checks, outputs."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Sequence

from metainfer.config import EngineConfig, ModelConfig
from metainfer.engine import slow_launch
from metainfer.engine.cache import CacheManager
from metainfer.engine.executors import PENDING
from metainfer.engine.request import Request, RequestOutput, SamplingParams, Status
from metainfer.engine.runner import InFlight, ModelRunner, ModelSource
from metainfer.engine.sampler import LogitBias, add_logit_bias
from metainfer.engine.scheduler import ScheduledBatch, Scheduler
from metainfer.spec.ngram import NgramIndex
from metainfer.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

log = logging.getLogger("metainfer.engine")


# what the steps covered (the oracle's coverage): steps per runner path (ModelRunner.launch), lone
# prefill steps (one prompt chunk and nothing else), mixed steps (prefill and decode rows),
# preemptions; and peaks: the widest decode step and verify step (sequences), the longest context
# (max num_computed_tokens after a step). Peaks are maxima since start or the last reset_peaks().
PEAK_STATS = ("max_decode_batch", "max_verify_batch", "max_position")
COVERAGE_STATS = {"path_decode_graph": 0, "path_prefill_graph": 0, "path_eager": 0,
                  "lone_prefill_steps": 0, "mixed_steps": 0, "preemptions": 0,
                  **dict.fromkeys(PEAK_STATS, 0)}


class RequestError(ValueError):
    """A request the engine refuses; the message is meant for the client."""


class LLMEngine:
    def __init__(self, ecfg: EngineConfig, progress: bool = True) -> None:
        self.ecfg = ecfg
        self.source = ModelSource.parse(ecfg.model, ecfg.load_format)
        self.model_config = ModelConfig.from_hf(self.source.config_path)
        model_dir = self.source.config_path.parent
        self.tokenizer: Tokenizer = load_tokenizer(ecfg.tokenizer or model_dir)
        self.max_model_len = min(ecfg.max_model_len, self.model_config.max_position_embeddings)
        slow_launch.install()  # a slow step launch names the Triton kernels it compiled
        self.runner = ModelRunner(ecfg, self.model_config, self.source, progress=progress)
        self.cache = CacheManager(self.runner.num_blocks, ecfg.block_size, self.runner.num_slots,
                                  self.runner.num_snapshots, ecfg.snapshot_interval)
        slow_launch.allocator_note(self.runner.device)  # the baseline a slow launch's note counts from
        self.scheduler = Scheduler(
            self.cache, ecfg.max_num_seqs, ecfg.max_num_batched_tokens, self.max_model_len,
            drafter=self._draft if ecfg.speculative else None,
            draft_kv=self.runner.mtp is not None,
        )
        eos = set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        self._grammar = None  # engine.grammar.GrammarBackend, built with the first structured request
        self._num_biased = 0  # unfinished requests with a logit_bias (`_bias_hook` is installed while > 0)
        self._bias_hook_prev = None  # the runner's logits_hook that `_bias_hook` chains
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._rng = random.Random(ecfg.seed)
        # (request, k) -> drafts (a test seam)
        mtp = self.runner.mtp
        self.proposer = {"repeat": self._repeat_proposer, "mtp": mtp and mtp.propose}.get(
            ecfg.speculative, self._ngram_proposer)
        self.async_scheduling = ecfg.async_scheduling
        self._pending: InFlight | None = None
        # speculation and async steps: drafts need the last tokens on the host when a step is scheduled,
        # so a verify runs synchronously and so does a probe step (the one before a proposal); after a
        # proposal that found nothing, 2, 4, ... SPEC_PROBE_MAX steps run async before the next probe
        self._host_tokens = True  # the batch being scheduled sees every sequence's last token
        self._spec_wait = 0  # async steps left before the next probe
        self._spec_misses = 0  # proposals in a row that found no drafts
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "aborted": 0,
                      "slow_launches": 0, "async_steps": 0, "spec_verifies": 0, "spec_drafted": 0,
                      "spec_accepted": 0, "spec_draft_errors": 0, **COVERAGE_STATS, **self.cache.stats}

    # ---- requests -----------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        score_only: bool = False,
    ) -> str:
        """Validates and queues a request; raises RequestError with a client-facing message."""
        params = params or SamplingParams()
        rid = request_id or self.new_request_id()
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise RequestError("prompt token ids must be integers") from None
        if not ids:
            raise RequestError("the prompt is empty: at least one token is needed")
        V = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of vocabulary [0, {V})")
        limit = self.max_model_len
        if len(ids) >= limit and not score_only or len(ids) > limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is {limit} tokens"
            )
        if params.max_tokens is None:
            max_tokens = limit - len(ids)
        else:
            max_tokens = params.max_tokens
            if len(ids) + max_tokens > limit and not score_only:
                raise RequestError(
                    f"this model's maximum context length is {limit} tokens; the request asks for "
                    f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to generate)"
                )
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < V]
        if bad_stop:
            raise RequestError(f"stop token id {bad_stop[0]} is out of vocabulary [0, {V})")
        bad_bias = [t for t, _ in params.logit_bias if not 0 <= t < V]
        if bad_bias:
            raise RequestError(f"logit_bias token id {bad_bias[0]} is out of vocabulary [0, {V})")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        grammar = self._grammar_matcher(params) if params.structured is not None else None
        det = (
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if params.detokenize else None
        )
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            params=params,
            seed=seed % (2**64),
            max_tokens=max_tokens,
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
            detokenizer=det,
            score_only=score_only,
            grammar=grammar,
            logit_bias=LogitBias.of(params.logit_bias) if params.logit_bias else None,
        )
        self.requests[rid] = req
        self.scheduler.add(req)
        if req.logit_bias is not None:
            self._num_biased += 1
            self._route_bias()
        return rid

    def _route_bias(self) -> None:
        """Installs `_bias_hook` as the runner's logits_hook while a request with a logit_bias is
        unfinished (chaining the hook that was there), and takes it out after the last one; without
        one, the runner's steps run as they would with no bias support."""
        runner, hook = self.runner, self._bias_hook
        if self._num_biased and runner.logits_hook != hook:
            self._bias_hook_prev, runner.logits_hook = runner.logits_hook, hook
        elif not self._num_biased and runner.logits_hook == hook:
            runner.logits_hook, self._bias_hook_prev = self._bias_hook_prev, None

    def _bias_hook(self, owners: list[tuple[Request, str, int]], logits) -> None:
        """The runner's logits_hook: adds each biased request's logit_bias to the logits row its next
        token is sampled from (logits [len(owners), V], in place, before any ban, mask or sampling),
        all rows in one device op. Biased requests are not greedy (`SamplingParams.greedy`), so their
        token comes from these rows and never from an argmax taken before the hook."""
        if self._bias_hook_prev is not None:
            self._bias_hook_prev(owners, logits)
        rows = [
            i for i, (r, kind, p) in enumerate(owners)
            if r.logit_bias is not None
            and (kind == "sample" or kind == "prompt" and not r.score_only and p == r.num_tokens - 1)
        ]
        if rows:
            add_logit_bias(logits, rows, [owners[i][0].logit_bias for i in rows])

    def _grammar_matcher(self, params: SamplingParams):
        """A matcher for params.structured, the grammar compiled now (RequestError if it cannot be)."""
        from metainfer.engine.grammar import GrammarBackend, GrammarError

        if params.min_tokens:  # (ignore_eos is fine: past the grammar's end only EOS is allowed)
            raise RequestError("structured outputs with min_tokens are not supported: "
                               "the grammar decides where the output ends")
        try:
            if self._grammar is None:
                self._grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size,
                                               self.eos_token_ids)
            return self._grammar.matcher(params.structured)
        except ImportError:
            raise RequestError("structured outputs need the llguidance package "
                               "(pip install 'metainfer[server]')") from None
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request at once and frees its cache; returns its final output (or None)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.remove(req)
        while req.output_token_ids and req.output_token_ids[-1] == PENDING:
            req.output_token_ids.pop()  # tokens of steps still running are dropped
        self._finish(req, "abort")
        self.stats["aborted"] += 1
        return self._output(req, [], "")

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches one batch; returns an output for every request that advanced or
        ended. With async scheduling the tokens of a plain sampling step are processed during the
        next call, while the GPU runs the step after it (the host never waits on an idle GPU)."""
        batch = self.scheduler.schedule()
        if not batch.items:
            return self._drain()
        sync = not self._async_ok(batch)
        self._note_shape(batch)
        outputs: list[RequestOutput] = []
        # the previous (async) step's tokens are processed after this launch, sync or not: a request
        # that token stops is still in this batch, and its blocks must outlive the launch
        now = time.monotonic()
        for req, _ in batch.items:
            req.first_scheduled_time = req.first_scheduled_time or now
        try:
            slow_launch.take()
            t0, c0 = time.perf_counter(), time.process_time()
            inflight = self.runner.launch(batch)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            self._note_slow_launch(batch, wall, slow_launch.take(), cpu)
        except Exception as e:  # a failed step fails its requests, never the engine
            log.exception("step failed")
            return (
                outputs
                + self._drain()
                + self._fail_batch(batch.items, f"internal error while running the model: {e}")
            )
        self.stats["steps"] += 1
        self.stats["async_steps"] += not sync
        self.stats[f"path_{inflight.path}"] += 1
        self._host_tokens = sync
        self._launched(inflight)
        outputs += self._drain()
        if sync:
            outputs += self._complete(inflight)
        else:
            self._pending = inflight
        return outputs

    def _note_shape(self, batch: ScheduledBatch) -> None:
        """Coverage counters of a scheduled step (host state only): a request's chunk is a prefill
        while it starts inside the prompt (a resumed request's recompute and scoring too), else a
        decode (a verify is a decode with drafts); a lone prefill is one generating request's
        prompt chunk alone in the step."""
        st = self.stats
        st.update(self.cache.stats)  # prefix cache: prompt tokens looked up and served, hit requests
        st["preemptions"] += len(batch.preempted)
        prefills = sum(r.num_computed_tokens < r.num_prompt_tokens for r, _ in batch.items)
        decodes = len(batch.items) - prefills
        verifies = sum(bool(r.draft_token_ids) for r, _ in batch.items)
        lone = len(batch.items) == 1 and prefills == 1 and not batch.items[0][0].score_only
        st["lone_prefill_steps"] += lone
        st["mixed_steps"] += prefills > 0 and decodes > 0
        st["max_decode_batch"] = max(st["max_decode_batch"], decodes)
        st["max_verify_batch"] = max(st["max_verify_batch"], verifies)

    def reset_spec_backoff(self) -> None:
        """Forgets the backoff of the speculation probes (`_async_ok`): the next step with generated
        tokens on the host proposes drafts again, whatever earlier batches found."""
        self._spec_misses = self._spec_wait = 0

    def reset_peaks(self) -> None:
        """Zeroes the peak counters (PEAK_STATS), so they cover the steps from now on."""
        self.stats.update(dict.fromkeys(PEAK_STATS, 0))

    SLOW_LAUNCH_S = 0.5  # a launch is host work (no GPU wait): this long means a JIT compile or worse

    def _note_slow_launch(self, batch: ScheduledBatch, seconds: float, compiled: list[str],
                          cpu_s: float) -> None:
        """Logs a step whose launch took SLOW_LAUNCH_S or more, with its shape, the Triton kernels it
        compiled, the allocator's new segments (`slow_launch`: the warmup's blind spots) and the
        process's CPU seconds in it (near the wall time: host work such as a compile; far below it:
        a wait). On the CPU every launch computes the step (no device queue), so a slow one means
        nothing: it is logged at debug level there."""
        if seconds < self.SLOW_LAUNCH_S:
            return
        self.stats["slow_launches"] += 1
        lens = [n for _, n in batch.items]
        log.log(
            logging.WARNING if self.runner.device.type == "cuda" else logging.DEBUG,
            "slow step launch %.2f s (CPU %.2f s): %d sequences, %d tokens, %d decodes, chunk lens %s, "
            "contexts %s; Triton compiled: %s; %s",
            seconds, cpu_s, len(lens), sum(lens), lens.count(1), [n for n in lens if n > 1][:8],
            [r.num_computed_tokens for r, n in batch.items if n > 1][:8], slow_launch.summary(compiled),
            slow_launch.allocator_note(self.runner.device) or "CPU",
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    SPEC_PROBE_MAX = 32  # async steps at most between two proposals that keep finding nothing

    def _async_ok(self, batch: ScheduledBatch) -> bool:
        """Whether this step may run async (its tokens processed during the next call). Called once
        per step: with speculation it also counts down to the next probe."""
        if not self.async_scheduling or not all(
            not r.score_only and r.params.logprobs is None and r.params.prompt_logprobs is None
            and r.grammar is None  # a mask needs the last token on the host
            for r, _ in batch.items
        ):
            return False
        if self.scheduler.drafter is None:
            return True
        if any(r.draft_token_ids for r, _ in batch.items):  # a verify: its acceptance shapes the next step
            self._spec_misses = 0
            return False
        if self._host_tokens and any(r.output_token_ids and r.draftable for r, _ in batch.items):
            self._spec_misses += 1  # the proposals for this batch found nothing: back off
            self._spec_wait = min(2**self._spec_misses, self.SPEC_PROBE_MAX)
        self._spec_wait -= 1
        return self._spec_wait > 0

    def _launched(self, inflight: InFlight) -> None:
        """Host bookkeeping right after a launch: progress, and a PENDING token per sampling row."""
        for req, n in inflight.items:
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.stats["prompt_tokens"] += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n
            if req.num_computed_tokens > self.stats["max_position"]:
                self.stats["max_position"] = req.num_computed_tokens
        for req, idx in inflight.samples:
            assert idx == len(req.output_token_ids)
            req.output_token_ids.append(PENDING)

    def _drain(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, None
        return self._complete(pending) if pending is not None else []

    def _complete(self, inflight: InFlight) -> list[RequestOutput]:
        """Applies a launched step's results to its requests (after waiting for its tokens)."""
        try:
            tokens = self.runner.wait(inflight)
        except Exception as e:
            log.exception("step failed")
            return self._fail_batch(inflight.items, f"internal error while running the model: {e}")
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for req, _ in inflight.items:
            rid = req.request_id
            if req.finished:
                continue
            if rid in inflight.prompt_logprobs:
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)
                req.prompt_logprobs.extend(inflight.prompt_logprobs[rid])
            if req.score_only:
                if rid in inflight.score_logits:
                    req.score_logits.append(inflight.score_logits[rid])
                if req.num_computed_tokens == req.num_tokens:
                    self.scheduler.remove(req)
                    self._finish(req, "length")
                    outputs.append(self._output(req, [], ""))
        for (req, idx), tok in zip(inflight.samples, tokens):
            if req.finished:  # aborted, or stopped by an earlier token while this step ran
                continue
            req.output_token_ids[idx] = tok
            if req.request_id in inflight.logprobs:
                req.logprobs.append(inflight.logprobs[req.request_id])
            reason = self._took(req, tok, idx + 1, now)
            if reason is not None:
                del req.output_token_ids[idx + 1 :]  # a token of a step still running, if any
            outputs.append(self._advanced(req, [tok], reason, n_out=idx + 1))
        for req, n in inflight.items:
            if req.request_id in inflight.verify and not req.finished:
                outputs.append(self._accept(req, n, inflight, now))
        return outputs

    def _took(self, req: Request, tok: int, n_out: int, now: float) -> str | None:
        """Bookkeeping of a new output token (the n_out-th): -> the stop reason it triggers, if any."""
        self.stats["generation_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if req.detokenizer is not None:
            req.detokenizer.add([tok])
        return self._check_stop(req, tok, n_out)

    def _advanced(self, req: Request, new: list[int], reason: str | None, n_out: int) -> RequestOutput:
        """The output of a request that took `new` tokens; finishes it if one of them stopped it."""
        if reason is not None:
            delta = self._final_text(req)
            self.scheduler.remove(req)
            self._finish(req, reason)
        else:
            delta = self._emit_text(req)
        return self._output(req, new, delta, n_out=n_out)

    def _accept(self, req: Request, n: int, inflight: InFlight, now: float) -> RequestOutput:
        """A speculative verify's result: the drafts that equal the greedy tokens are accepted, and
        the greedy token after them is taken too. If a draft was rejected, the DeltaNet states go
        back to before the step and the step's accepted tokens are recomputed by the next one (a
        few tokens more in a memory-bound step; the KV rows past them are simply overwritten)."""
        greedy, drafts = inflight.verify[req.request_id], req.draft_token_ids
        j = 0
        while j < len(drafts) and greedy[j] == drafts[j]:
            j += 1
        self.stats["spec_verifies"] += 1
        self.stats["spec_drafted"] += len(drafts)
        self.stats["spec_accepted"] += j
        if j < len(drafts):
            self.runner.restore_state(req, inflight.saved_states[req.request_id])
            req.num_computed_tokens -= n
        self._note_acceptance(req, j)
        req.draft_token_ids = []
        new: list[int] = []
        reason = None
        for tok in greedy[: j + 1]:
            req.output_token_ids.append(tok)
            new.append(tok)
            reason = self._took(req, tok, len(req.output_token_ids), now)
            if reason is not None:
                break
        return self._advanced(req, new, reason, n_out=len(req.output_token_ids))

    def _note_acceptance(self, req: Request, accepted: int) -> None:
        """Per-request backoff for drafts that verify to nothing: a verify costs a few decode steps and
        a rejection also recomputes the step's tokens. After r verifies in a row that accepted no draft,
        the request passes up its next min(2^r, SPEC_PROBE_MAX) drafting chances; one accepted draft
        resets it. `repeat` (the oracle's verify-path mode) never backs off."""
        if self.ecfg.speculative == "repeat":
            return
        if accepted:
            req.spec_rejects = 0
        else:
            req.spec_rejects += 1
            req.spec_skip = min(2**req.spec_rejects, self.SPEC_PROBE_MAX)

    def _draft(self, req: Request, k: int) -> list[int]:
        """The scheduler's drafter: up to k drafts from `proposer` for a greedy request without
        logprobs whose last token is on the host; none for any other."""
        if not req.draftable or (req.output_token_ids and req.output_token_ids[-1] == PENDING):
            return []
        if req.spec_skip > 0:  # its last verifies accepted nothing (`_note_acceptance`)
            req.spec_skip -= 1
            return []
        sch = self.scheduler
        if len(sch.running) > self.ecfg.speculative_max_seqs or sch.waiting:
            return []
        try:
            return self.proposer(req, min(k, self.ecfg.num_speculative_tokens))
        except Exception:  # drafts are optional: the step goes on without them, the request unharmed
            self.stats["spec_draft_errors"] += 1
            log.exception("drafting failed for request %s; no drafts this step", req.request_id)
            return []

    @staticmethod
    def _repeat_proposer(req: Request, k: int) -> list[int]:
        return [req.token_at(req.num_tokens - 1)] * k

    @staticmethod
    def _ngram_proposer(req: Request, k: int) -> list[int]:
        if req.spec_index is None:
            req.spec_index = NgramIndex()
        return req.spec_index.propose(req.tokens_slice(0, req.num_tokens), k)

    def _check_stop(self, req: Request, tok: int, n_out: int) -> str | None:
        """n_out: tokens generated up to and including `tok`."""
        if n_out >= req.params.min_tokens:
            if tok in req.eos_token_ids:
                req.stop_reason = None
                return "stop"
            if tok in req.params.stop_token_ids:
                req.stop_reason = tok
                return "stop"
            if req.params.stop and req.detokenizer is not None:
                text = req.detokenizer.text
                for s in req.params.stop:
                    if s in text[max(0, len(req.text) - len(s)) :]:
                        req.stop_reason = s
                        return "stop"
        if n_out >= req.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _emit_text(req: Request) -> str:
        """Moves decoded text to the emitted text (`req.text`), holding back a tail that could still
        become the start of a stop string, so a stream never shows text the final output drops."""
        if req.detokenizer is None:
            return ""
        full = req.detokenizer.text
        upto = len(full)
        for s in req.params.stop:  # the earliest position whose suffix is a proper prefix of s
            for i in range(max(len(req.text), len(full) - len(s) + 1), len(full)):
                if s.startswith(full[i:]):
                    upto = min(upto, i)
                    break
        delta = full[len(req.text) : upto]
        req.text = full[:upto]
        return delta

    @staticmethod
    def _final_text(req: Request) -> str:
        """Final text: truncated at a matched stop string, else everything decoded; returns the part
        not yet emitted."""
        if req.detokenizer is None:
            return ""
        if isinstance(req.stop_reason, str):
            full = req.detokenizer.text
            cut = full.find(req.stop_reason, max(0, len(req.text) - len(req.stop_reason)))
            full = full[: cut + (len(req.stop_reason) if req.params.include_stop_str_in_output else 0)]
        else:
            req.detokenizer.flush()
            full = req.detokenizer.text
        delta = full[len(req.text) :]
        req.text = full
        return delta

    def _finish(self, req: Request, reason: str) -> None:
        if req.logit_bias is not None and not req.finished:
            self._num_biased -= 1
            self._route_bias()
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self.requests.pop(req.request_id, None)
        self.stats["finished"] += 1
        if self.runner.mtp is not None:
            self.runner.mtp.forget(req)

    def _fail_batch(self, items: list[tuple[Request, int]], message: str) -> list[RequestOutput]:
        outs = []
        for req, _ in items:
            if req.finished:
                continue
            req.error = message  # (before its release: a failed step's KV is never cached)
            self.scheduler.remove(req)
            self._finish(req, "error")
            outs.append(self._output(req, [], ""))
        return outs

    def _output(
        self, req: Request, new_ids: list[int], new_text: str, n_out: int | None = None
    ) -> RequestOutput:
        """n_out: how many output tokens are known (later ones may belong to a step still running)."""
        score = None
        if req.score_only and req.finished and req.score_logits:
            import torch

            score = torch.cat(req.score_logits, dim=0)
            req.score_logits = []
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids[:n_out] if n_out is not None else list(req.output_token_ids),
            text=req.text,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            error=req.error,
            num_preemptions=req.num_preemptions,
            ttft=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
            e2e=(req.finish_time - req.arrival_time) if req.finish_time else None,
            score_logits=score,
        )
