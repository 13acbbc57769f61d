"""Prompt logprobs: how likely the model found each prompt token (None for the first)."""

from memra import LLM, SamplingParams


def main():
    llm = LLM(model="demo")
    prompt = "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?"
    outputs = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0))
    output = outputs[0]
    print(f"prompt: {output.prompt!r}")
    assert output.prompt_logprobs[0] is None
    for token_id, entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        own = entry[token_id]
        print(f"{own.decoded_token!r:>12}: {own.logprob:8.3f} (rank {own.rank})")
        assert own.logprob <= 0 and own.rank >= 1 and len(entry) <= 3
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)


if __name__ == "__main__":
    main()
