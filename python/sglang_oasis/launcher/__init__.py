"""What ``python -m sglang_oasis.launch_server`` decides before SGLang starts: ``argv`` (reading the
command line), ``cpu_engine`` (the CPU engine's defaults), ``sparse_mode`` (sparse mode's arguments and
refusals)."""
