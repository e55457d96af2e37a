"""`python -m bench.export.run`: the SFT export bench (bench/export/bench_export.py) under the uniform bench entry point."""

from bench.export.bench_export import main

if __name__ == "__main__":
    main()
