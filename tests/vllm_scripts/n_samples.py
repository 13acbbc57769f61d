"""Several samples per prompt (n), and the same prompt many times: unseeded samples differ."""

from memra import LLM, SamplingParams


def main():
    llm = LLM(model="demo", max_model_len=256)
    sampling_params = SamplingParams(n=4, temperature=1.0, max_tokens=10)
    outputs = llm.generate(["ROMEO:"], sampling_params)
    for completion in outputs[0].outputs:
        print(f"[{completion.index}] {completion.text!r} ({completion.finish_reason})")
    texts = [c.token_ids for c in outputs[0].outputs]
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2, 3]
    assert len({tuple(t) for t in texts}) > 1, "n unseeded samples should differ"

    # The same prompt sixteen times, no seed: sixteen draws.
    outputs = llm.generate(["ROMEO:"] * 16, SamplingParams(temperature=0.8, max_tokens=6))
    distinct = {tuple(o.outputs[0].token_ids) for o in outputs}
    print(f"{len(distinct)} distinct samples out of 16")
    assert len(distinct) > 1


if __name__ == "__main__":
    main()
