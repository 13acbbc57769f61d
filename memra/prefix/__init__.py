"""Prefix caching, exact on hybrids too (promise E8): memra.prefix.serving says what is cached and how
a hit resumes; memra.prefix.tree the pages' tree; memra.prefix.store their blocks and snapshots;
memra.prefix.policy how much may be kept."""
