"""The one loop that decides the next token, for every entry point (the HTTP server, `memra generate`,
`memra chat`, memra.LLM):

    scheduler.py   pure-Python continuous batching: who prefills how much, who decodes, who is swapped
    engine.py      the loop: schedule -> execute on the model -> sample every row on the device -> events
    sampler.py     one step's tokens for the whole batch on the device, one copy to the host
    backends.py    what the engine runs on: the model in this process, or a process pipeline
    types.py       EngineConfig, TokenEvent, Unavailable
    llm.py         memra.LLM: a batch of prompts in, one output per prompt out
"""
