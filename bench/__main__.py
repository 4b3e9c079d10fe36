"""python -m bench {conversation,throughput,cpu-shape,quality,regrade,compare,penalties,profile,forward,kernels,roofline,gpu,memory,serve,stall,studio}: the Fast-dLLM v2 benchmarks."""
from __future__ import annotations

import argparse
import sys

from . import (compare, conversation, cpu_shape, forward, gpu, kernels, memory, penalties, profile, quality, regrade, roofline,
               serve, stall, studio, throughput)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    throughput.add_parser(sub)
    conversation.add_parser(sub)
    cpu_shape.add_parser(sub)
    quality.add_parser(sub)
    regrade.add_parser(sub)
    compare.add_parser(sub)
    penalties.add_parser(sub)
    profile.add_parser(sub)
    forward.add_parser(sub)
    kernels.add_parser(sub)
    roofline.add_parser(sub)
    gpu.add_parser(sub)
    memory.add_parser(sub)
    serve.add_parser(sub)
    stall.add_parser(sub)
    studio.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
