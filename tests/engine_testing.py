"""Test helpers shared by the engine tests.

Part I: a runner that records what the engine asked of it, plugged in through the engine's
`runner_class` seam (S05, S06), and a way to drive several streams of one engine in turn.
Part II (the one step engine, S09 on): the per-prompt oracles of a tiny random model
(`tiny_references`, `tiny_fixture`), `greedy` params, `drive` (requests arriving and aborted
at given steps, with a per-chapter check after every step and the idle check at the end), and
runner wrappers that tests plug in by composition (`NaNRows`, `LogitsRecorder`): the engine is
never subclassed."""

import dataclasses


def counting_engine(engine_class):
    """A subclass of `engine_class` whose runner records each call in `engine.runner.calls`:
    ("prefill", prompt tokens) or ("decode", positions cached before the step)."""
    base = engine_class.runner_class

    class CountingRunner(base):
        def __init__(self, model, max_seq_len=None):
            super().__init__(model, max_seq_len)
            self.calls: list[tuple[str, int]] = []

        def prefill(self, prompt_ids):
            self.calls.append(("prefill", len(prompt_ids)))
            return super().prefill(prompt_ids)

        def decode(self, token):
            self.calls.append(("decode", self.cache.num_cached))
            return super().decode(token)

    return type(f"Counting{engine_class.__name__}", (engine_class,),
                {"runner_class": CountingRunner})


def run_in_turns(streams):
    """Advance the streams one step each, in turn, until all are done; their Completions."""
    pending = dict(enumerate(streams))
    while pending:
        for i, stream in list(pending.items()):
            if next(stream, None) is None:
                del pending[i]
    return [stream.result for stream in streams]


def id_text(ids) -> str:
    """Token ids as the text IdTokenizer (tests/model_testing.py) encodes back to them."""
    return " ".join(map(str, ids))


def tiny_references(name: str, directory, prompts, context: int, max_new_tokens: int):
    """Build the tiny random HF model `name` in directory and return (HF model, S06 model,
    {prompt index: (S05's greedy completion alone, HF generate's greedy ids alone)}): the two
    independent oracles every Part II engine test compares each request with."""
    import torch

    import s03_transformer as s03
    import s04_sampling as s04
    import s05_kv_cache as s05
    import s06_torch as s06
    from model_testing import EOS_UNUSED, PAD, IdTokenizer, build_tiny

    hf = build_tiny(name, directory)
    model = s06.TorchTransformer.from_pretrained(directory)
    s05_engine = s05.Engine(s03.Transformer.from_pretrained(directory), IdTokenizer(), context)
    params = s04.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    references = {}
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                              dtype=torch.long), max_new_tokens=min(max_new_tokens,
                                                                    context - len(ids)),
                              do_sample=False, eos_token_id=EOS_UNUSED, pad_token_id=PAD)
        references[i] = (s05_engine.generate(id_text(ids), params), out[0, len(ids):].tolist())
    return hf, model, references


def greedy(max_tokens: int = 8, **kwargs):
    """Greedy SamplingParams (temperature 0) for max_tokens tokens, other fields as given."""
    import s04_sampling as s04
    return s04.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def bundled_alone(model, tokenizer):
    """alone(prompt, max_tokens): the greedy tokens (EOS ignored) of S05's NumPy engine on the
    request alone, checked against S06's engine alone (model, tokenizer: the bundled model as
    `s06_torch.load()` gives it); cached. The oracle of the paged runners' tests (S16, S17)."""
    import s03_transformer as s03
    import s05_kv_cache as s05
    import s06_torch as s06
    numpy_model = s03.Transformer.from_pretrained(s03.BUNDLED_MODEL_DIR)
    s05_engine = s05.Engine(numpy_model, tokenizer, numpy_model.config.max_position_embeddings)
    s06_engine = s06.Engine(model, tokenizer)
    cache = {}

    def get(prompt, max_tokens):
        if (prompt, max_tokens) not in cache:
            params = greedy(max_tokens, ignore_eos=True)
            tokens = s05_engine.generate(prompt, params).token_ids
            assert s06_engine.generate(prompt, params).token_ids == tokens
            cache[prompt, max_tokens] = tokens
        return cache[prompt, max_tokens]

    return get


def tiny_fixture(prefix: str, names, prompts, context: int, max_new_tokens: int, *,
                 with_directory: bool = False):
    """A module-scoped pytest fixture over the tiny random models `names`: (name, HF model,
    S06 model, {prompt index: (S05 alone, HF alone)}) for each (`tiny_references`), and the
    checkpoint directory last if with_directory (to load the model again, on another device)."""
    import pytest

    @pytest.fixture(scope="module", params=list(names))
    def tiny(request, tmp_path_factory):
        directory = tmp_path_factory.mktemp(f"{prefix}_{request.param}")
        hf, model, references = tiny_references(request.param, directory, prompts, context,
                                                max_new_tokens)
        if with_directory:
            return request.param, hf, model, references, directory
        return request.param, hf, model, references

    return tiny


def drive(engine, requests, arrivals, aborts=None, check=None):
    """Run requests [(prompt, params) or (prompt, params, {add_request keywords})] through
    `add_request` / `step`: request i is added before step call arrivals[i]; aborts: {step
    call: [request index]}; check(engine, call, outputs), if given, runs after every step
    (each chapter's invariants). At the end every request has had its last output, and the
    engine is idle: nothing waits or runs and the KV manager holds no token (invariant 8 of
    the course plan). Returns ({index: [outputs]}, {index: request id})."""
    aborts = aborts or {}
    ids, outputs, call = {}, {}, 0
    while len(ids) < len(requests) or engine.has_unfinished_requests():
        for i, at in enumerate(arrivals):
            if at == call and i not in ids:
                prompt, params, *keywords = requests[i]
                ids[i] = engine.add_request(prompt, params, **(keywords[0] if keywords else {}))
        for i in aborts.get(call, []):
            if i in ids:
                engine.abort(ids[i])
        got = engine.step()
        index_of = {rid: i for i, rid in ids.items()}
        for output in got:
            outputs.setdefault(index_of[output.request_id], []).append(output)
        if check is not None:
            check(engine, call, got)
        call += 1
    assert set(outputs) == set(ids), "a request ended without a last output"
    assert all(outs[-1].finished for outs in outputs.values())
    assert not engine.scheduler.has_unfinished_requests() and not engine.requests
    assert engine.scheduler.kv.num_used_tokens == 0
    return outputs, ids


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def text_of(outputs) -> str:
    return "".join(o.text_delta for o in outputs)


class RunnerWrapper:
    """A runner that delegates everything to the runner it wraps (tests override
    `execute_model` to see or change what the real one returns)."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute_model(self, plan, requests):
        return self.runner.execute_model(plan, requests)


class NaNRows(RunnerWrapper):
    """Gives the sampled rows of request `bad` NaN logits once it has `after` output tokens
    (set `bad` after the engine is built: `engine.runner = NaNRows(engine.runner)`): its one
    row, or with S15's drafts all its 1 + d rows."""

    def __init__(self, runner, bad: str | None = None, after: int = 1):
        super().__init__(runner)
        self.bad, self.after = bad, after

    def execute_model(self, plan, requests):
        out = self.runner.execute_model(plan, requests)
        if self.bad in out.req_ids and len(requests[self.bad].output_ids) >= self.after:
            logits = out.logits.clone()
            i = out.req_ids.index(self.bad)
            rows = [1 + d for d in out.num_draft_tokens] or [1] * len(out.req_ids)
            start = sum(rows[:i])
            logits[start:start + rows[i]] = float("nan")
            out = dataclasses.replace(out, logits=logits)
        return out


class LogitsRecorder(RunnerWrapper):
    """Keeps a copy of the logits of every row that sampled, per request, in `logits`."""

    def __init__(self, runner):
        super().__init__(runner)
        self.logits: dict[str, list] = {}

    def execute_model(self, plan, requests):
        out = self.runner.execute_model(plan, requests)
        for row, rid in enumerate(out.req_ids):
            self.logits.setdefault(rid, []).append(out.logits[row].clone())
        return out


class FailingRunner(RunnerWrapper):
    """Runs the real `execute_model`, then raises RuntimeError while `failures` > 0 (one
    fewer each time): a model run that fails late, after it wrote its KV (a whole-step
    failure: `step()` raises, the plan is reverted). Set `failures` when the step should
    fail: `engine.runner = FailingRunner(engine.runner)`."""

    def __init__(self, runner, failures: int = 0):
        super().__init__(runner)
        self.failures = failures

    def execute_model(self, plan, requests):
        out = self.runner.execute_model(plan, requests)
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("injected: the model run failed")
        return out


class FIFOAdmission:
    """An observer that checks S09's admission rule at every plan: the requests admitted in
    the step are the oldest waiting ones, in arrival order, and a request is left waiting
    only when every seat (max_num_seqs) is taken."""

    def on_plan(self, engine, plan) -> None:
        scheduler = engine.scheduler
        admitted = [engine.requests[rid].arrival for rid in plan.scheduled_new_ids]
        assert admitted == sorted(admitted), "FIFO: admitted out of arrival order"
        if scheduler.waiting:
            assert len(scheduler.running) == scheduler.max_num_seqs, "waits beside a free seat"
            first_left = min(r.arrival for r in scheduler.waiting)
            assert all(a < first_left for a in admitted), "FIFO: a later request overtook"

    def on_step(self, engine, result) -> None:
        pass


def fifo_step_check(engine):
    """S09's per-step invariants for `drive`: attaches a `StepTracer` and a `FIFOAdmission`
    observer to the engine and returns (tracer, check), where check(engine, call, outputs)
    asserts that every request scheduled in the step sampled, and made exactly one token
    unless the sampler refused its row (it ended with an error), and that no other request
    made one (a step without a record made none)."""
    from s09_trace import trace
    tracer = trace(engine)
    engine.observers.append(FIFOAdmission())
    seen = [tracer.num_recorded]

    def check(engine, call, outputs):
        assert all(len(o.new_token_ids) <= 1 for o in outputs)
        made = sorted(o.request_id for o in outputs if o.new_token_ids)
        if tracer.num_recorded == seen[0]:
            assert not made, f"call {call}: tokens without a step"
            return
        seen[0] = tracer.num_recorded
        record = tracer.records[-1]
        refused = {o.request_id for o in outputs if o.error is not None}
        assert sorted(record.running) == sorted(record.sampled), (call, record)
        assert made == sorted(set(record.running) - refused), (call, record)

    return tracer, check
