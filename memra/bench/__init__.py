"""Benchmarks (`memra bench`): what the user-facing paths reach, against the device's own limits.

`memra bench model` (model_bench drives it): config, probes, roofline, memra_cells, user_paths, hf_peer,
fit, report. `memra bench serve` (a load-test client of any OpenAI-compatible server): serve_client,
serve_report, serve_checks. command holds both subcommands' flags; memra.cli wires it in.
"""
