"""Offline batch generation, written as vLLM's examples are: only the import and the model name differ."""

from memra import LLM, SamplingParams

# Sample prompts.
prompts = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo,",
    "First Citizen:\nBefore we proceed",
    "KING LEAR:\nBlow, winds,",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12)


def main():
    # Create an LLM.
    llm = LLM(model="demo", trust_remote_code=True, dtype="auto", max_num_seqs=8)
    # Generate texts from the prompts. The output is a list of RequestOutput objects
    # that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)
    assert [o.prompt for o in outputs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason in ("stop", "length") for o in outputs)
    assert len({o.request_id for o in outputs}) == len(prompts)


if __name__ == "__main__":
    main()
