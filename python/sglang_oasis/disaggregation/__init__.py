"""Prefill/decode disaggregation over the Mooncake transfer engine.

Importing this package checks that exactly one Mooncake build is installed (see ``mooncake_builds``).

Remote partial fetching inside SGLang's PD disaggregation (``--oasis-remote-fetch``, sparse mode).

SGLang's Mooncake sender would push a request's whole KV from the prefill node into the decode node's
pool. With remote partial fetching the two nodes' sparse backends take over the payload::

    prefill node (scheduler process)                    decode node (scheduler process)
    extend -> last prompt token's selection             pre-allocates the request's pages as usual
    last send: stage full KV + summaries (registered)   SGLang transfer completes (one page)
      SGLang sends only the last page + aux data   -->  commit: GET the hand-off (layout, selection),
      hand-off kept for GET /handoff/<room>               read the union over heads of the selected
                                                          blocks + every summary (Mooncake reads)
                                                        first decode step: working sets = selection
                                                        later misses: read before their first load
    DELETE /handoff/<room>: staging released     <--    request finished (or its slot reused)

The hand-off travels over a small HTTP side channel in the prefill scheduler process (it owns the staged
memory); the decode node finds it through the prefill's own bootstrap server, where the prefill
registers the channel's URL per engine rank (a route sglang-oasis adds, hook 7 in ``sglang_hooks``).
A prefill node that does not stage (dense mode, or ``--oasis-remote-fetch false``) registers nothing, and
its requests arrive whole, as in plain SGLang.

With ``--oasis-lookahead eagle3`` the draft model's own KV (one layer, which attends every token) is
staged beside the target's and read whole at admission: SGLang's transfer would carry it with the
target's pages, and only the last page goes that way here.

Blocks the decode node already holds through its radix cache (SGLang's ``decode_prefix_len``) are
neither staged for reading nor read. With ``--disaggregation-decode-enable-radix-cache`` a request's
still-remote blocks are read in the background after its admission (one completion worker, never the
scheduler thread), and its KV enters the radix cache at its finish only if they all arrived by then (a
cached prefix is always complete; a request that finished first is just not shared); without it they are
never read.

The files: ``side_channel`` (the HTTP side channel, its auth, the hand-off URL look-up and route),
``handoff`` (what travels over it), ``prefill_stager`` and ``send_plan`` (the prefill side: the staging,
and which sends are staged), ``decode_queue`` (SGLang's decode transfer queue under remote fetching),
``decode_admission`` and ``decode_fetcher`` (the decode side), ``staging`` (the staged memory),
``remote_fetch`` (the Mooncake reads into the host tier), ``transfer_engine`` (the Mooncake engine). The
hooks in ``sglang_hooks`` (hook 7) hand SGLang's arguments to these files and decide nothing.
"""

from sglang_oasis.disaggregation.mooncake_builds import check_single_mooncake_build

check_single_mooncake_build()
