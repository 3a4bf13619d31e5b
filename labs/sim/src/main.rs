//! `leasehold-sim`: a deterministic OpenAI-compatible model server plus a small
//! web (SearxNG-style `/search`, `/page/...`) and an effects sink, all on one
//! port, for the offline demo and the tests.
//!
//! Routes are assembled from one module per concern: [`model`] serves
//! `/v1/chat/completions` and `/stats`, [`web`] serves `/search` and `/page/...`,
//! [`effects`] serves `/effects`.

use clap::Parser;

mod accounting;
mod effects;
mod model;
mod web;

/// What `--help` says beyond the flags: the endpoints, the environment
/// variables and the fault file's format.
const SIM_HELP: &str = "\
Endpoints:
  POST /v1/chat/completions   OpenAI-compatible chat (streamed or not, tools, response_format)
  GET  /v1/models             {\"object\":\"list\",\"data\":[{\"id\":\"sim-1\",...}]}
  GET  /search?q=...&format=json   SearxNG-style search results
  GET  /page/SLUG             the pages the search results link to
  GET  /stats                 chat requests served so far (also response_formats, tools_offered,
                              text_tool_calls, rate_limited by limit, rate_limited_total, provider,
                              serve, interrupted, waited, generating_peak)
  GET  /limits                the rate limits per model and their use; POST /limits
                              {\"model\":\"sim-1\",\"rpm\":N,\"tpm\":N,\"concurrency\":N,\"burst\":SECS,
                              \"retry_after_form\":\"seconds\"|\"http_date\"} sets one (none of the three: removes)
  POST /accounting/invoices   an accounting system (the invoice example's destination): invoices
                              unique by supplier + number, GET ?supplier=&number= looks one up,
                              GET /accounting/suppliers?name=, POST /accounting/faults arms
                              commit_then_timeout, commit_then_500, rate_limit, lookup_ambiguous;
                              GET /accounting/creates counts the creates per business key
  POST /effects               the effects sink (Idempotency-Key honoured); GET /effects lists,
                              GET /effects/count counts, POST /effects/faults arms a fault

Environment variables (besides the flags' own: LH_SIM_LISTEN, LH_SIM_SEED, LH_SIM_FAULTS,
LH_SIM_PROVIDER, LH_SIM_CONTEXT_CHARS, LH_SIM_LIMIT, LH_SIM_SERVE, LH_SIM_RETRY_AFTER_FORM):
  LH_SIM_TOKEN_DELAY_MS   pause between streamed tokens, ms [default: 2; 0 for tests]
  LH_SIM_FAULT_RATE       share of chat requests that fault, 0 to 1 [default: 0]
  LH_SIM_FAULT_KINDS      kinds drawn at that rate, comma-separated
                          [default: cut,empty,error_event,rate_limit,overloaded]
  LH_SIM_EFFECTS_FAULTS   effects-sink faults armed at start: mode[:count],...
                          (commit_then_timeout, timeout_before_commit, empty_success,
                          commit_twice, error_5xx, commit_then_5xx, commit_late)
  LH_SIM_EFFECTS_HANG     how long a hanging effects fault hangs [default: 30s]
  LH_SIM_ACCOUNTING_STATE a file the accounting system journals its books to (synced before
                          each create is answered) and reads back at start: they survive kill -9
  LH_SIM_EFFECTS_DEDUPE   whether a repeated Idempotency-Key replays the first result
                          [default: true]
  RUST_LOG                log filter [default: info]

Providers (--provider, LH_SIM_PROVIDER; unknown paths get each one's 404):
  openai     json_schema and json_object, native tools (arguments streamed in fragments),
             stream_options.include_usage honoured; errors {\"error\":{message,type,param,code}},
             bad request 400, context overflow 400 code context_length_exceeded.
  llama-cpp  as llama-cpp-python's server: response_format json_schema is refused with HTTP 500
             {\"error\":{\"message\":\"[{'type': 'literal_error', 'loc': ('body', 'response_format',
             'type'), ...}]\",\"type\":\"internal_server_error\",\"param\":null,\"code\":null}};
             json_object with a \"schema\" gets an instance of it; tools are ignored (prose);
             a bad request is a 500 of that validation shape; context overflow is 400
             \"This model's maximum context length is M tokens. However, you requested N tokens
             ...\" (param messages, code context_length_exceeded).
  vllm       json_schema, json_object and native tools; errors are a top-level
             {\"object\":\"error\",\"message\",\"type\":\"BadRequestError\",\"param\":null,\"code\":400}
             with HTTP 400, context overflow included.
  ollama     json_schema, json_object and native tools, each streamed tool call whole in one
             chunk; no usage chunk even when asked; errors {\"error\":{...,\"type\":
             \"invalid_request_error\",\"param\":null,\"code\":null}} 400; context overflow is
             silent: the oldest messages after the system prompt are dropped.
--serve (LH_SIM_SERVE): parallel (every request at once), serialized (one generation at a time;
the others wait: llama-server with one slot, Ollama with OLLAMA_NUM_PARALLEL=1) or interrupts (one
at a time, and a request arriving while a stream generates ends that stream after its next chunk
with data: [DONE] and no finish_reason, then is served: llama-cpp-python's server by default).
Streamed headers go out at once; the first chunk waits for the model. /stats counts interrupted,
waited and generating_peak.

--context-chars N (LH_SIM_CONTEXT_CHARS) is the window, in characters of the messages' JSON
(tokens in messages = characters / 4); 0 = no limit.

Text tool protocol (any provider): a system message containing `<tool_call>{\"name\": ` offers
the tools named in it; the sim then plans search, fetch, section as with native tools but
answers with content lines <tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"...\"}}</tool_call>
(finish_reason stop) and reads user messages <tool_result name=\"TOOL\">...</tool_result> as
the results.

Model fault kinds: cut, empty, error_event, rate_limit, quota, server_error, overloaded,
hang, slow, malformed_args, context_exceeded, refusal, html (200 text/html page),
not_found (404 {\"detail\":\"Not Found\"}), unauthorized (401 invalid_api_key),
invalid_request_500 (500, llama-cpp's validation body). A request header
`x-sim-fault: KIND` always fires; then the --faults file's rules; then the rate.

The --faults file: {\"rules\": [{\"kind\": \"cut\", \"nth\": [2, 5]},
  {\"kind\": \"rate_limit\", \"every\": 4, \"retry_after\": \"1\"},
  {\"kind\": \"slow\", \"rate\": 0.5, \"delay_ms\": 50, \"match\": \"reliability\"}]}
Rule fields: kind (required); when: nth (1-based request numbers), every, rate (from the
seed), after (from the Nth request on), times (at most this often), match (the last user
message contains it), above_chars (the messages exceed it); parameters: retry_after
(seconds, rate_limit), delay_ms (slow). A rule with no condition fires on every request.";

/// Command-line options. Every flag also reads `LH_SIM_<FLAG>`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "leasehold-sim",
    version,
    about = "Deterministic OpenAI-compatible model server, web and effects sink for leasehold's demo and tests",
    after_long_help = SIM_HELP
)]
pub struct Args {
    /// Address to listen on, e.g. 127.0.0.1:8089 (port 0 picks a free port; the bound address is printed on stdout as `listening on ADDR`).
    #[arg(long, env = "LH_SIM_LISTEN", default_value = "127.0.0.1:8089")]
    pub listen: String,
    /// Seed of every deterministic choice (same seed + same request = same answer).
    #[arg(long, env = "LH_SIM_SEED", default_value_t = 0)]
    pub seed: u64,
    /// JSON file of fault rules (format below, in --help).
    #[arg(long, env = "LH_SIM_FAULTS")]
    pub faults: Option<std::path::PathBuf>,
    /// Which OpenAI-compatible server to answer as: openai, llama-cpp, vllm or ollama (how they differ is below, in --help).
    #[arg(long, env = "LH_SIM_PROVIDER", value_enum, default_value = "openai")]
    pub provider: model::Provider,
    /// Context window in characters of the request's messages (0 = no limit); a request over it gets the provider's context-length error (ollama truncates instead).
    #[arg(long, env = "LH_SIM_CONTEXT_CHARS", default_value_t = 0)]
    pub context_chars: usize,
    /// A provider rate limit, `[MODEL:]rpm=N,tpm=N,concurrency=N[,burst=SECS]` (repeatable; no model: every model not named; `burst` = seconds of refill a bucket holds, default 60). A request over it gets 429 with `Retry-After`; `POST /limits` changes them at run time.
    #[arg(long, env = "LH_SIM_LIMIT", value_delimiter = ';', value_parser = model::limits::LimitSpec::parse)]
    pub limit: Vec<model::limits::LimitSpec>,
    /// How many requests the model generates at once: parallel, serialized (one at a time, the others wait) or interrupts (one at a time, and a newcomer ends the stream in flight with [DONE] before its finish reason, as llama-cpp-python's server does by default).
    #[arg(long, env = "LH_SIM_SERVE", value_enum, default_value = "parallel")]
    pub serve: model::serve::Serve,
    /// How a limit's 429 writes `Retry-After`: seconds (rounded up) or http-date.
    #[arg(
        long,
        env = "LH_SIM_RETRY_AFTER_FORM",
        value_enum,
        default_value = "seconds"
    )]
    pub retry_after_form: model::limits::RetryAfterForm,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let app = model::router(&args)?
        .merge(web::router(&args)?)
        .merge(effects::router(&args)?)
        .merge(accounting::router(&args)?);
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
