"""Sample logprobs: the chosen token and the top k per position, as {token_id: Logprob}."""

import math

from memra import LLM, SamplingParams


def main():
    llm = LLM(model="demo")
    sampling_params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    output = llm.generate(["HAMLET:\nTo be, or not to be"], sampling_params)[0].outputs[0]
    print(f"text: {output.text!r}")
    print(f"cumulative logprob: {output.cumulative_logprob:.4f}")
    for token_id, position in zip(output.token_ids, output.logprobs):
        chosen = position[token_id]
        ranked = ", ".join(f"{lp.decoded_token!r}: {lp.logprob:.3f} (rank {lp.rank})" for lp in position.values())
        print(f"{chosen.decoded_token!r:>12} -> {ranked}")
        assert chosen.rank == 1  # greedy picks the likeliest
        assert 3 <= len(position) <= 4
    total = sum(p[t].logprob for t, p in zip(output.token_ids, output.logprobs))
    assert math.isclose(total, output.cumulative_logprob, rel_tol=1e-9)


if __name__ == "__main__":
    main()
