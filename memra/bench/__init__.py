"""Benchmarks (`memra bench`): what the user-facing paths reach, against the device's own limits."""
