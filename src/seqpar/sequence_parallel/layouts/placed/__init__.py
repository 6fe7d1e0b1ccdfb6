"""The placed layout: whole short documents on one rank, long ones split over few ranks, work and traffic even.

``placed_layout`` solves it from the global position ids (no communication); ``shard_batch(layout="placed")``
calls it and reorders the row. The solver is in ``seqpar.sequence_parallel.layouts.placed.solver``.

Note [placed layout]
    Under packed documents a query sees only its own document, so where a document sits in the row does
    not change any output: only that it stays one contiguous run with its own position ids (Note
    [documents from position ids]). The balanced layout (Note [balanced layout]) evens the work by
    cutting the row into many small chunks and scattering them, which cuts most documents and makes their
    keys travel. The placed layout instead *reorders* the row per batch and then cuts it into equal chunks
    (a ``ChunkLayout`` over the reordered row, so every strategy, planner and ``kv_needs`` table runs on
    it unchanged):
    - a document is *long* when it holds more tokens than a rank's share ``L`` or more attention work
      than ``WORK_SLACK`` of a rank's mean work. Long documents go first, each over few ranks
      (``layouts.placed.split``). A causal one that needs at most two ranks, or one whose work per token
      is flat (a window much shorter than it, or bidirectional), is cut into contiguous pieces from its
      end: a rank takes the document's chunks backwards while its work, its free tokens counted as filled
      by the cheapest whole documents left, stays within the first of ``FILL_TARGETS``; then the rank with
      the most room goes on. A causal document's tail is its most expensive part per token, so the tail's rank
      holds the fewest of its tokens and its head's keys travel to one rank only (a head ``h`` costs ``2h``
      tokens sent and ``h`` returned). A flat document that this would spread over more ranks than its
      tokens and work need is cut into equal runs over that many ranks instead. A causal document that
      needs three ranks or more is cut into ``2m`` equal runs, runs ``i`` and ``2m-1-i`` on one rank (the
      zigzag of one document, so its work is even with few pieces);
    - every rank then gets one contiguous *home* run of chunks, filled with whole short documents,
      longest first, by the better of two rules: the run least full in work and tokens together, or the
      run left with the most work room once its free tokens are counted at the mean work per token of the
      documents not yet placed. Then whole documents are moved or exchanged between the most loaded run
      and another while that lowers the larger of their loads and both runs still hold them.
      A gap left at the end of a rank's home run is filled with padding while the padding budget lasts,
      else with the head of one more document, whose rest opens the next rank's home run (the only cut,
      and it moves that head's keys only);
    - inside a home run documents keep their order in the row.
    The slacks, shares and limits named here are the constants of ``split``, ``home``, ``chain``, ``refine``
    and ``solver``, documented where they are defined.
    Tokens: the reordered row holds ``S' = P k c`` tokens (chunk length ``c``, about a 32nd of ``S/P``; a
    rank's consecutive chunks are tiled as one run, so small chunks do not make small kernel calls;
    ``k`` chunks per rank), every rank holds exactly ``k c``, and padding takes
    the rest: ``k`` is the fewest chunks that hold the row, or one more when that stays within
    ``TOKEN_SLACK`` of ``S/P`` (see the refining pass below), so each rank's tokens, padding
    included, are within ``TOKEN_SLACK`` of the mean ``S/P``. Padding is its own document (position ids from 0,
    labels ignored, ``token_mask`` 0; it restarts at every chunk, so it costs one tile per chunk), so no
    real token sees it.
    Work: what the ring's plans of the placed row compute (``planner.plan_cost``; ``layout_balance``
    reports it). The planner tiles a rank's run of chunks as one span cut at document starts (Note [masked
    tiles]), so a document's piece on one rank costs its visible keys at the plain cost plus its diagonal
    squares (``square_extra``: seqpar's CPU kernel computes a square's diagonal 512-key blocks whole,
    ``tiles.square_parts``); cutting a document into pieces on different ranks makes its squares
    smaller and the total work lower. The builders count each token's visible keys plus an even share of
    its document's squares (``_token_work``); the refining pass counts them exactly per rank from its runs.
    With a causal window, a query tile a window or more into its document also computes the masked tile the
    band's edge crosses (``token_costs``): exact on the grid a window's tiles follow, approximate where a run
    end moves it (close to the plans; the measured gap is in docs/benchmarks.md).
    Refining pass (``layouts.placed.refine``): the row's order is then fixed and only which rank holds
    each chunk changes. A rank's score is its work (at least ``BALANCE_SLACK`` of the mean), ``OVER`` per
    unit of work above that (far above a token's traffic), and ``key_cost`` per token of K/V traffic (keys it
    sends count twice, forward and backward; keys it receives once, their gradients go home; per document, each
    rank needs one interval of keys: its document's start, or its first query minus the window, to its last
    query). While it lowers the largest score, the pass exchanges a chunk of the top rank with another
    rank's chunk: the few exchanges that look best by loads and a guess of the traffic each move adds are
    scored exactly, and the best is taken when the top rank falls and no rank rises to it. Evening the work
    comes first (that is the balance target), then traffic: a cut is made only where the work needs it, and
    a batch already within the slack is left as it is. The target stays fixed during a pass (a cut lowers the
    mean, and a moving target would turn each cut into an excess elsewhere); a new pass starts from the new
    mean while a rank is above it (at most ``PASSES`` passes, ``REFINE_ROUNDS`` exchanges in all).
    Short documents only: when every document holds at most ``S/(2P)`` tokens, the candidates keep every
    document whole and are not refined, so ring and all-gather move no K/V at all (the limit of dynamic
    context parallelism, with the mesh unchanged). The candidate with the least traffic (none, where the
    padding lets whole documents fill the runs), then the most even work, is taken; its work is as even as
    whole documents allow, which on a short row with few documents per rank can be well above the slack.
    Candidates: the row is built and refined twice, with ``k`` and with ``k + 1`` chunks per rank (more
    padding, more room to keep documents whole), and the refined candidate taken is within the balance
    target, then has the least traffic on its busiest rank, then the least work on it (ties: fewer chunks).
    A candidate with no traffic at all ends the search. A third candidate, the *chain*
    (``layouts.placed.chain``, with ``k + 1`` chunks per rank), applies where some documents are *dense*
    (longer than a rank's share, or with too much work to share a rank even with the cheapest fill the row
    allows) but each fits two shares, and there are at most ``P / 2`` of them: every rank holds one
    contiguous run of the row, and each dense document crosses one run end, its head ending run ``r`` and
    its tail opening run ``r + 1`` (alternate ends, so no run both sends a head and receives a tail). The
    tail's work is the largest share of the mean (``TAIL_SHARES``, largest first) whose runs ``assign_homes``
    can even (else the most even within ``REFINE_ROOM`` of the mean), then each document's share is moved by
    ``SHARE_STEP`` while that
    lowers the busiest run's traffic; documents
    no run holds whole are cut at the run ends no dense document crosses. Only the heads' keys travel, to
    one rank each; the refining pass then evens what the builders' work model left above the target.
    While the whole short documents cannot even the
    home runs, the tail's share of a long document is lowered (through ``FILL_TARGETS``)
    before the refining pass has to cut documents.
    Bytes: a document holding most of the row's work must be spread over every rank to even the work,
    and its keys then travel whatever the placement. The benchmarks' ``traffic_floor`` (benchmarks/floor.py,
    Note [traffic floor]) bounds the busiest rank's traffic from below over every placement even within the
    slacks: on a row where one document holds most of the work, even the floor is a large share of what zigzag
    needs while zigzag leaves its busiest rank far above the mean work (docs/benchmarks.md, "Masks and
    layouts", has the measured bytes; ``python -m benchmarks.placement`` reports placed over the floor per row).
    A batch whose documents all fit whole and whose padding suffices has no document on two ranks:
    ``kv_needs`` is then empty between ranks and ring and all-gather move no K/V at all.
    Not reordered: rows with block-causal ranges (blocks are global token ranges), batches whose rows hold
    different documents (one order must serve every row of the layout), and rows whose first document
    started in an earlier row. There the placed layout is the balanced layout of the row as it is.
    ``shard_batch`` returns the order (``shard.placement.order``: the source index of each placed token,
    -1 for padding); ``Placement.restore`` puts a gathered placed row back in the batch's order.
    ``layout="auto"`` (``resolve_auto_layout``) picks per batch, from the global position ids only (so
    every rank picks the same, with no communication): the placed layout when the rows are packed
    documents (the position ids restart inside a row) and no block-causal ranges are given, else the
    balanced layout (on plain causal rows it evens the work as zigzag does; with blocks the row is not
    reordered anyway). ``shard.layout`` is then the ``ChunkLayout`` the chosen one made, its ``name``
    ("placed" or "balanced") says which, and the model call and the gather take it unchanged.
"""

from __future__ import annotations

from seqpar.sequence_parallel.layouts.placed.auto import resolve_auto_layout
from seqpar.sequence_parallel.layouts.placed.solver import Placement, placed_layout

__all__ = ["Placement", "placed_layout", "resolve_auto_layout"]
