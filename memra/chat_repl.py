"""`memra chat`: a conversation with a model, turn by turn, on one engine that keeps its prefix cache.

Each turn renders the whole conversation with the chat template and sends it to the engine, which
resumes from the longest cached aligned prefix of it (memra.prefix): the previous turns' prompt pages are
reused, the previous answer is primed again as prompt text. Ctrl-C while a reply streams stops that
reply between two engine steps (never inside one, so the engine and its cache stay consistent) and the
chat goes on; the partial answer stays in the conversation, as the user saw it. Ctrl-C at the prompt,
end of input or /exit ends the chat; /reset clears the conversation.

A message may span lines, in the two ways people know from llama.cpp and Ollama: a line ending in a
backslash continues on the next, and a line of three double quotes opens a block that the next such line
closes. Turn t samples with seed + t, so a conversation replays from its seed (the banner prints it).
Commands (/help, /reset, /exit) are handled here and never reach the model.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading

from memra.cli_common import drawn_seed, fit, sampling_params
from memra.errors import MemraError

HELP = ("commands: /help shows this, /reset clears the conversation, /exit (or Ctrl-D) ends the chat; Ctrl-C stops "
        "a reply. End a line with \\ to continue it, or put a message between lines of \"\"\".")
COMMANDS = ("/help", "/reset", "/exit")


def chat_loop(args, model) -> int:
    from memra.engine.llm import LLM
    from memra.generate import GenerationStats

    tok = model.tokenizer
    if not tok.chat_template:
        raise MemraError(f"{args.model}: the model has no chat template; use `memra generate` instead")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    llm = None  # one engine for the session, built at the first message: its warm-up, graphs and prefix cache serve every turn
    seed = drawn_seed(args)
    params = sampling_params(args, seed)  # checked once, before the first turn
    sampling = "greedy (--temperature 0)" if params.greedy else f"seed {seed} (--seed {seed} replays this conversation)"
    print(f"memra chat: {args.model} ({model.cfg.arch}, {model.device}); {sampling}. Type /help for the commands.",
          file=sys.stderr, flush=True)
    turn = 0
    while True:
        try:
            text = read_message(sys.stdin, ">>> " if interactive else None)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        if text is None or text.strip() == "/exit":
            return 0
        if text.strip() == "/reset":
            history.clear()
            print("[conversation cleared]", file=sys.stderr)
            continue
        if text.strip() == "/help":
            print(HELP, file=sys.stderr, flush=True)
            continue
        if text.strip().startswith("/") and len(text.split()) == 1:  # a mistyped command is not a message
            print(f"[unknown command {text.strip()[:40]}; /help lists them]", file=sys.stderr, flush=True)
            continue
        if not text.strip():
            continue
        if llm is None:
            llm = LLM(model, max_batch=1, enable_prefix_caching=args.prefix_caching)
        history.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(system + history, add_generation_prompt=True))
        turn_params = fit(dataclasses.replace(params, seed=seed + turn), len(ids), model.cfg.max_position)
        stats, reply = GenerationStats(), []
        with _ctrl_c_stops() as stop:
            for piece in llm.stream(ids, turn_params, stats, interrupt=stop):
                reply.append(piece)
                print(piece, end="", flush=True)
        print()
        if stats.finish_reason == "abort":
            print("[stopped]", file=sys.stderr)
        print(f"[{stats.prompt_tokens} prompt tokens, {stats.cached_tokens} from the cache; "
              f"{stats.generated_tokens} generated]", file=sys.stderr, flush=True)
        history.append({"role": "assistant", "content": "".join(reply).strip()})
        turn += 1


def read_message(stream, prompt: str | None) -> str | None:
    """One user message from `stream` (None at end of input): a line, or several joined by a trailing
    backslash or enclosed in lines of three double quotes. `prompt` is shown before each line on a terminal."""
    lines: list[str] = []
    block = False
    while True:
        if prompt is not None:
            print(prompt if not lines and not block else "... ", end="", flush=True)
        line = stream.readline()
        if not line:  # end of input: what was typed so far is the message
            return "\n".join(lines) if lines else None
        line = line.rstrip("\n")
        if line.strip() == '"""':
            if block:
                return "\n".join(lines)
            block = True
            continue
        if block:
            lines.append(line)
        elif line.endswith("\\"):
            lines.append(line[:-1])
        else:
            return "\n".join([*lines, line])


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
