"""Test helpers shared by the engine tests: a runner that records what the engine asked of it,
plugged in through the engine's `runner_class` seam (S05, S06), a way to drive several streams
of one engine in turn, the per-prompt oracles of a tiny random model (S09-S11), and an
engine whose one request gets NaN logits and one that keeps the sampled rows' logits
(S11, S12)."""


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
    """Token ids as the text IdTokenizer (tests/test_s03_transformer.py) encodes back to them."""
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
    from test_s03_transformer import EOS_UNUSED, PAD, IdTokenizer, build_tiny

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


def nan_for(engine_class):
    """A subclass of a chunking engine (S11 on) that gives request `engine.bad`'s sampled row
    NaN logits from its second token on, through the `execute_model` seam (rows in batch
    order, as `_forward_step` reads them)."""

    class NaNFor(engine_class):
        bad = None

        def execute_model(self, batch):
            logits = super().execute_model(batch)
            out = self.scheduler_output
            rows = sorted((self.requests[r] for r in out.num_scheduled_tokens),
                          key=lambda s: s.slot)
            for i, seq in enumerate(rows):
                if (seq.request_id == self.bad and seq.output_ids
                        and seq.request_id in out.sample_ids):
                    logits = logits.clone()
                    logits[i] = float("nan")
            return logits

    return NaNFor


class SampledLogits:
    """A mixin for a chunking engine (S11 on) that keeps a copy of the logits of every row
    that sampled, per request, in `engine.logits`, through the `execute_model` seam (rows in
    batch order, as `_forward_step` reads them)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: dict[str, list] = {}

    def execute_model(self, batch):
        logits = super().execute_model(batch)
        out = self.scheduler_output
        rows = sorted((self.requests[r] for r in out.num_scheduled_tokens), key=lambda s: s.slot)
        for i, seq in enumerate(rows):
            if seq.request_id in out.sample_ids:
                self.logits.setdefault(seq.request_id, []).append(logits[i].clone())
        return logits
