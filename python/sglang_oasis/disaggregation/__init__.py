"""Prefill/decode disaggregation over the Mooncake transfer engine.

Importing this package checks that exactly one Mooncake build is installed (see ``mooncake_builds``).
"""

from sglang_oasis.disaggregation.mooncake_builds import check_single_mooncake_build

check_single_mooncake_build()
