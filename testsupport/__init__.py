"""What the tests and the benchmarks (and scripts/readme-clone.sh) share, importable from the
repository root (pytest's ``pythonpath`` has it; a benchmark puts the root on ``sys.path``):

  server     the service on 127.0.0.1 in this process (start_server, LiveServer)
  postgres   a real PostgreSQL from the installed binaries (start_postgres)
  talker     random in-process talker bundles and a small tokenizer (make_bundle, make_tokenizer)
  long_text  long texts and a recording engine for the long-text and long-job paths
  hub        a Hugging Face hub on 127.0.0.1 (LocalHub)

Not part of the installed package: pyproject's package list names engines, service and clients only.
"""
