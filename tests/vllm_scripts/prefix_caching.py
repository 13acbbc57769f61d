"""Automatic prefix caching: two questions after one long shared prefix; the second reuses its pages.
In memra the cached answer is also the very answer a cold engine gives (bit for bit)."""

import time

from memra import LLM, SamplingParams

LONG_PROMPT = "You read plays. Here is one.\n" + "ROMEO: But soft, what light through yonder window breaks?\n" * 8


def get_generation_time(llm, sampling_params, prompts):
    start_time = time.time()
    output = llm.generate(prompts, sampling_params=sampling_params)
    end_time = time.time()
    print("-" * 30)
    print(f"Output: {output[0].outputs[0].text!r}")
    print(f"Cached prompt tokens: {output[0].num_cached_tokens}")
    print(f"Generation time: {end_time - start_time:.3f} seconds.")
    return output[0]


def main():
    llm = LLM(model="demo", enable_prefix_caching=True)
    sampling_params = SamplingParams(temperature=0, max_tokens=8)
    get_generation_time(llm, sampling_params, LONG_PROMPT + "Question: who speaks? Answer:")
    second = get_generation_time(llm, sampling_params, LONG_PROMPT + "Question: what breaks? Answer:")
    assert second.num_cached_tokens > 0

    cold = LLM(model="demo", enable_prefix_caching=False)
    again = cold.generate(LONG_PROMPT + "Question: what breaks? Answer:", sampling_params)[0]
    assert again.outputs[0].token_ids == second.outputs[0].token_ids and again.num_cached_tokens == 0


if __name__ == "__main__":
    main()
