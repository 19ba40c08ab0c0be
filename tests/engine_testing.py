"""Test helpers shared by the engine tests of S05 and S06: a runner that records what the
engine asked of it, plugged in through the engine's `runner_class` seam, and a way to drive
several streams of one engine in turn."""


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
