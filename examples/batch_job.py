"""An offline batch job: launch every prompt at once from one thread, then collect the answers.
The engine keeps the batch full as short answers finish and long ones go on.

    python examples/batch_job.py
"""

import time

from runtime import Engine, GenerationConfig

TOPICS = ["rivers", "mountains", "deserts", "forests", "oceans", "glaciers", "volcanoes", "islands",
          "caves", "lakes", "canyons", "reefs", "tundra", "savannas", "wetlands", "prairies"]

with Engine.from_pretrained() as engine:
    config = GenerationConfig(max_new_tokens=48)
    start = time.perf_counter()
    handles = {t: engine.launch_response([{"role": "user", "content": f"One fact about {t}."}], config)
               for t in TOPICS}
    answers = {t: engine.tokenizer.decode(list(engine.stream_response_tokens(h)), skip_special_tokens=True)
               for t, h in handles.items()}
    wall = time.perf_counter() - start
    for topic, answer in answers.items():
        print(f"{topic:>10}: {answer.strip()[:110]}")
    generated = engine.stats()["tokens_generated"]
    print(f"\n{len(TOPICS)} prompts, {generated} tokens in {wall:.2f} s ({generated / wall:.0f} tokens/s)")
