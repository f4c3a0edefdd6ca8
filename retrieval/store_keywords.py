"""The keyword search's budget: which of a question's words an FTS5 search can afford to read
on this index (`retrieval.keywords.affordable`), each tokenised by the index's own tokenizer."""

from __future__ import annotations

from sqlite_utils import Database

from retrieval.keywords import affordable, keyword_terms
from retrieval.store_schema import FTS_TOKENIZER

#: How many keyword-index entries one search may read (`retrieval.keywords.affordable`).
KEYWORD_POSTINGS = 5_000


class QueryWords:
    """One connection's scratch tables that tokenise a query (made on first use)."""

    def __init__(self) -> None:
        self._ready = False

    def affordable(self, db: Database, query: str) -> list[str]:
        """The question's words that the keyword search can afford to read (`affordable`):
        each word is tokenised by FTS5 itself (a scratch table with the index's tokenizer, so
        stems and identifier parts are exactly the index's), and each token's document count
        comes from the index's vocabulary. Sub-millisecond; it keeps a search on a 100k-chunk
        index from scoring every chunk that holds a common word."""
        words = keyword_terms(query)
        if not words:
            return []
        conn = db.conn
        with db.atomic():  # scratch rows in the temp schema: main is not locked
            if not self._ready:
                conn.execute(
                    "CREATE VIRTUAL TABLE IF NOT EXISTS temp.query_words USING "
                    f"fts5(word, tokenize='{FTS_TOKENIZER}')"
                )
                conn.execute(
                    "CREATE VIRTUAL TABLE IF NOT EXISTS temp.query_tokens USING "
                    "fts5vocab(temp, query_words, 'instance')"
                )
                conn.execute(
                    "CREATE VIRTUAL TABLE IF NOT EXISTS temp.chunk_terms USING "
                    "fts5vocab(main, chunks_fts, 'row')"
                )
                self._ready = True
            conn.executemany(
                "INSERT INTO temp.query_words(rowid, word) VALUES (?, ?)", list(enumerate(words))
            )
            tokens: dict[int, list[str]] = {}
            for n, term in conn.execute("SELECT doc, term FROM temp.query_tokens"):
                tokens.setdefault(int(n), []).append(str(term))
            conn.execute("DELETE FROM temp.query_words")
        distinct = sorted({t for ts in tokens.values() for t in ts})
        docs: dict[str, int] = {}
        for start in range(0, len(distinct), 500):
            part = distinct[start : start + 500]
            marks = ",".join("?" * len(part))
            docs.update(
                conn.execute(
                    f"SELECT term, doc FROM temp.chunk_terms WHERE term IN ({marks})", part
                ).fetchall()
            )
        # a phrase reads all its tokens' entries, and matches nothing if one token is absent
        postings = [
            sum(docs.get(t, 0) for t in tokens.get(i, []))
            if tokens.get(i) and all(docs.get(t, 0) for t in tokens[i])
            else 0
            for i in range(len(words))
        ]
        return affordable(words, postings, KEYWORD_POSTINGS)
