"""Seeds: a request's seed repeats its sample; LLM(seed=...) repeats a whole run, unseeded requests included."""

from memra import LLM, SamplingParams

prompts = ["ROMEO:", "JULIET:", "HAMLET:"]


def run(seed):
    llm = LLM(model="demo", seed=seed, max_model_len=256)
    return [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=8))]


def main():
    llm = LLM(model="demo", max_model_len=256)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=42)
    first = llm.generate(["ROMEO:"] * 2, seeded)
    again = llm.generate("ROMEO:", seeded)
    print(f"seed 42: {first[0].outputs[0].text!r}")
    assert first[0].outputs[0].text == first[1].outputs[0].text == again[0].outputs[0].text

    a, b = run(7), run(7)
    print(f"LLM(seed=7), twice: {a} / {b}")
    assert a == b


if __name__ == "__main__":
    main()
