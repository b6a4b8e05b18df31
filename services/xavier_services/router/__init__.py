"""The router: public gRPC `RouterService` and an OpenAI-compatible HTTP front in one process.

One request, file by file: `main` starts both fronts over one `core.Router`. The gRPC front is
`servicer` (`RouterService`; `TokenInterceptor` checks the bearer token); the HTTP front is `openai_http`
(`/v1/models`, `/v1/completions`, `/v1/chat/completions`, SSE), which decodes bodies with `openai_body`,
parses and shapes them with `openai_shapes` and `openai_logprobs`, sends SSE keepalives through
`keepalive`, and is guarded by `http_guard` (connection cap, header deadline) and `http_errors`
(aiohttp's own answers in OpenAI's error shape). Both fronts hand a request to `core`:

- `request`: `prepare`, the validated request (token ids, sampling, mode) a flow runs; `prompts` turns
  its prompt into token ids (chat rendering, the prompt-fingerprint cache, model facts), and `offload`
  tokenizes very large prompts in a helper process.
- `core`: `Router.generate`: a serving slot from `admission`, the mode, the flow in its own task, its
  steps read back with a progress deadline, the metrics and log line of `observe`.
- `stream`: what the flow's task hands the reader (a step, ended, failed) and the responses built from
  the steps.
- the flows, each an async iterator of `flows.Step`: `flows` (what they share: failover, the typed
  errors of a failed or stalled peer, a peer silent past `decode_progress_seconds` failed like a dead one
  as `pacing` watches; and colocated on a unified peer), `pd` (P/D: a pair picked and called in the
  order it declares; the sequential order, the prefill then the decode from its first token, through a
  directory room or a pair handoff), `pd_concurrent` (a pair that declares HANDOFF_PROTOCOL_CONCURRENT:
  prefill and decode called at once, the decode streaming its own first token) and `native` (SGLang's
  own prefill and decode servers over HTTP, concurrently).
- `pair_call`: what every P/D flow shares: how a pair is called, read from what its peers declare
  (`call_order`, `pair_handoff`, `first_token_source`; never an engine's name), the concurrent order's
  read loop (`concurrently`, a failed prefill ending the request at once) and the one cleanup
  (`PairCall`: cancel the calls, release the pair's slots, abort the room or release the source of a
  request that did not finish).
- `migration`: wraps the P/D and colocated flows; a decode that fails or stalls after tokens reached the
  client (`flows.StreamBroken`) is replaced by another pair that re-prefills prompt + tokens sent, with
  max_tokens and min_tokens less them, the seed advanced and the tokens sent marked as resumed output
  (penalties and grammars continue over them), at most `migration_limit` times; `seam_text` renders the
  text after the seam as the first engine would have.
- `peers`: live peers from the directory, channels (and call sessions) to them, least-outstanding-work
  pair selection with prefix affinity; `health` leaves failing peers out and probes them back.
- `peer_calls`: the flows' Prefill, ReleaseSource and Decode calls, on the peer's call session when it
  declares one and `peer_sessions` is on, else one RPC each; both fail with the same gRPC errors.
- `config`: `RouterConfig` (TOML, `XAVIER_*` environment, flags), validated at start.
"""
