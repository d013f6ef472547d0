"""TokenDance's algorithms in plain Python/torch: no SGLang import, tested fast on the CPU."""
