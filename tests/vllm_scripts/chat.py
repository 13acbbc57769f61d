"""LLM.chat: one conversation, then a batch of them, through the model's chat template."""

from memra import LLM, SamplingParams


def print_outputs(outputs):
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}")
        print(f"Generated text: {generated_text!r}")
    print("-" * 80)


def main():
    llm = LLM(model="demo")
    sampling_params = SamplingParams(max_tokens=10, temperature=0.5, top_p=0.9, top_k=-1)

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # You can run batch inference with llm.chat API
    conversations = [conversation for _ in range(3)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print_outputs(outputs)
    assert len(outputs) == 3 and all(len(o.outputs[0].token_ids) <= 10 for o in outputs)
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    assert outputs[0].prompt == rendered and outputs[0].prompt_token_ids == tokenizer.encode(rendered)


if __name__ == "__main__":
    main()
