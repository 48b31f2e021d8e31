"""Quick start: one engine, the embedded SmolLM2 model, a streamed chat answer."""

from runtime import Engine, GenerationConfig

with Engine.from_pretrained() as engine:  # no argument: the embedded SmolLM2-135M-Instruct
    question = [{"role": "user", "content": "Why is the sky blue? Answer in two sentences."}]
    for piece in engine.stream_response(question, GenerationConfig(max_new_tokens=80)):
        print(piece, end="", flush=True)
    print()
