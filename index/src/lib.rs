//! Cache index, ranker and policy: plain library code behind the LookupRoute family of RPCs.
