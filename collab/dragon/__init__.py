"""DRAGON (distributed RAG by output aggregation), everything both sides share: the
aggregation math (`aggregation`), the aggregator scheduler (`schedule`), the per-token
bookkeeping (`ledger`), one side's loop over a link (`peer`) and the sequence-wise baseline
(`sequence`). Its wire messages are a family of `collab.protocol` (`protocol.dragon`)."""
