"""`memra chat`: a conversation with a model, turn by turn, on one engine that keeps its prefix cache.

Each turn renders the whole conversation with the chat template and sends it to the engine, which
resumes from the longest cached aligned prefix of it (memra.prefix): the previous turns' prompt pages are
reused, the previous answer is primed again as prompt text. Ctrl-C while a reply streams stops that
reply between two engine steps (never inside one, so the engine and its cache stay consistent) and the
chat goes on; the partial answer stays in the conversation, as the user saw it. Ctrl-C at the prompt,
end of input or /exit ends the chat; /reset clears the conversation.
"""

from __future__ import annotations

import signal
import sys
import threading

from memra.cli_common import fit
from memra.errors import MemraError


def chat_loop(args, model) -> int:
    from memra.engine.llm import LLM
    from memra.generate import GenerationStats
    from memra.sampling import SamplingParams

    tok = model.tokenizer
    if not tok.chat_template:
        raise MemraError(f"{args.model}: the model has no chat template; use `memra generate` instead")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    # one engine for the session: its warm-up, graphs and prefix cache serve every turn
    llm = LLM(model, max_batch=1, enable_prefix_caching=args.prefix_caching)
    turn = 0
    while True:
        if interactive:
            print(">>> ", end="", flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            history.clear()
            print("[conversation cleared]", file=sys.stderr)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(system + history, add_generation_prompt=True))
        params = fit(SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed + turn,
                                    max_tokens=args.max_tokens), len(ids), model.cfg.max_position)
        stats, reply = GenerationStats(), []
        with _ctrl_c_stops() as stop:
            for piece in llm.stream(ids, params, stats, interrupt=stop):
                reply.append(piece)
                print(piece, end="", flush=True)
        print()
        if stats.finish_reason == "abort":
            print("[stopped]", file=sys.stderr)
        print(f"[{stats.prompt_tokens} prompt tokens, {stats.cached_tokens} from the cache; "
              f"{stats.generated_tokens} generated]", file=sys.stderr, flush=True)
        history.append({"role": "assistant", "content": "".join(reply).strip()})
        turn += 1


class _ctrl_c_stops:
    """While a reply streams: SIGINT sets an event the stream checks between engine steps."""

    def __enter__(self) -> threading.Event:
        self.event = threading.Event()
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, lambda *_: self.event.set())
        return self.event

    def __exit__(self, *exc) -> None:
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
