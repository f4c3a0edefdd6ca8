"""Shared by device and cloud: the wire protocol and the decoding math. Imports nothing of ours.

Where each piece of the wire protocol and the math (docs pages "protocol", "math") lives
(module.function):

wire protocol           protocol (package: codec = header, limits, encode/decode; session,
                        split, dragon = the message families); split.Transcript (committing
                        tokens the same way on both sides), split.wire_probs (float16 as sent)
speculative             verification.residual          norm(max(0, p − q))
     verification       verification.accept_probability min(1, p(x)/q(x))
                        verification.verify_one, verification.speculative_round (+ bonus token)
split variants          variants (registry: get_variant, variant_names, register), one module each:
     DSD                variants.dsd.Dsd               verification.dsd_round
     DSSD               variants.dssd.Dssd             verification.dssd_cloud_verify (p/q, the
                                                       paper's swap corrected),
                                                       verification.dssd_device_resample
     DSSD top-K         variants.dssd.DssdTopK         verification.picospec_residual_topk,
     (approximate)                                     verification.picospec_topk_bias_tv
     TK-SLT             variants.tk_slt.TkSlt          variants.tk_slt.truncate (top-K
                                                       covering 99.9 % of q),
                                                       verification.tkslt_cloud_verify
     draft length       scheduling.tk_slt_gamma0 (closed form, Lambert W),
                        scheduling.tk_slt_optimal_draft_length, scheduling.choose_draft_length
                        (measured costs, round trip included; AS²: use_cloud_only)
PicoSpec                scheduling.picospec_expected_round_time (eq. 9)
RAPID                   verification.rapid_target (p̂), verification.rapid_residual,
                        verification.rapid_verify_one
DRAGON                  dragon (package): dragon.aggregation.local_mixture (p^s),
                        dragon.aggregation.side_weight (h^s), dragon.aggregation.side_etas
                        (η^l, η^r), dragon.aggregation.aggregate_sample and
                        dragon.aggregation.speculative_aggregation (Algorithm 1);
                        dragon.schedule.dragon_per_token_latency / dragon_choose_aggregator
                        (eq. 7); dragon.ledger (per-token bookkeeping both sides run),
                        dragon.peer (one side's loop over a link), dragon.sequence (DRDG/SW);
                        scheduling.OnlineProfiler, fit_decode_latency, DecodeSlopeEstimator
sampling                softmax, distribution (temperature, top-k, top-p), sample_from, sample
plumbing                the lowest layer, imports nothing else of collab: what both sides keep
                        on disk: plumbing.files (atomic writes, file hashes), plumbing.paths
                        (where things live), plumbing.migrations (PRAGMA user_version engine)

Functions whose docstring starts "Reference only" are the equations in their textbook form:
tests and benchmarks check the shipped paths against them; neither side calls them.
"""
