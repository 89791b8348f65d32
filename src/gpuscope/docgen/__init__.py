"""Generators of the documentation pages that read more than one generator's output.

- ``sources``: docs/sources.md, what each source supports, from the generated rules and dashboards.
"""
