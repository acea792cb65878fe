//! A minimal proxy-wasm (ABI 0.2.1) host on wasmtime, for driving the compiled filter.
//!
//! It implements just the host calls the filter imports — logging, header
//! maps, buffers, unary gRPC calls, metrics, stream continuation, effective
//! context — plus the few WASI calls Rust's std makes (`random_get`,
//! `fd_write`, environment and clock queries); any other import traps, so a
//! new dependency of the filter shows up as a clear test failure. gRPC calls
//! are recorded, never sent: the test answers them with [`ProxyWasmHost::grpc_success`]
//! or [`ProxyWasmHost::grpc_failure`]. Single-threaded; each call into the
//! guest runs to completion. Cost: the module is compiled once per host.
//!
//! Included by the filter test binaries with `#[path]`; each uses a subset.
#![allow(
    dead_code,
    reason = "shared by several test binaries, each using a subset"
)]

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context as _, anyhow, bail};
use wasmtime::{Caller, Engine, Extern, Instance, Linker, Memory, Module, Store};

/// Root context id the host uses.
pub const ROOT_CONTEXT: u32 = 1;

const STATUS_OK: i32 = 0;
const STATUS_NOT_FOUND: i32 = 1;
const STATUS_BAD_ARGUMENT: i32 = 2;
const STATUS_PARSE_FAILURE: i32 = 4;

const MAP_REQUEST_HEADERS: i32 = 0;
const MAP_RESPONSE_HEADERS: i32 = 2;
const BUFFER_REQUEST_BODY: i32 = 0;
const BUFFER_GRPC_RECEIVE: i32 = 5;
const BUFFER_VM_CONFIGURATION: i32 = 6;
const BUFFER_PLUGIN_CONFIGURATION: i32 = 7;

/// What a guest callback asked the host to do with the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Continue iteration.
    Continue,
    /// Stop iteration (and buffer, for body callbacks).
    Pause,
}

/// One recorded `proxy_grpc_call`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcCall {
    /// Token returned to the guest.
    pub token: u32,
    /// Context that was effective when the call was made.
    pub context: u32,
    /// Upstream (cluster) name.
    pub cluster: String,
    /// Fully qualified service name.
    pub service: String,
    /// Method name.
    pub method: String,
    /// Serialized request message.
    pub message: Vec<u8>,
    /// Timeout in milliseconds.
    pub timeout_ms: u32,
}

#[derive(Debug, Default)]
struct Stream {
    request_headers: Vec<(String, String)>,
    request_body: Vec<u8>,
    response_headers: Vec<(String, String)>,
    resumed: u32,
    /// Properties by path (parts joined with '.'): seeded by the test
    /// (route metadata, say) or set by the filter (filter state).
    properties: HashMap<String, Vec<u8>>,
}

#[derive(Default)]
struct HostState {
    plugin_configuration: Vec<u8>,
    effective: u32,
    streams: HashMap<u32, Stream>,
    grpc_calls: Vec<GrpcCall>,
    next_token: u32,
    grpc_receive: Vec<u8>,
    clusters: HashSet<String>,
    metric_names: Vec<String>,
    metric_values: Vec<i64>,
    logs: Vec<(i32, String)>,
    /// The last period the filter asked the timer for (0: off).
    tick_period_ms: u32,
}

impl HostState {
    fn stream(&mut self) -> &mut Stream {
        self.streams.entry(self.effective).or_default()
    }

    fn map(&mut self, map_type: i32) -> Option<&mut Vec<(String, String)>> {
        match map_type {
            MAP_REQUEST_HEADERS => Some(&mut self.stream().request_headers),
            MAP_RESPONSE_HEADERS => Some(&mut self.stream().response_headers),
            _ => None,
        }
    }
}

/// The filter instantiated under the host.
pub struct ProxyWasmHost {
    store: Store<HostState>,
    instance: Instance,
    next_context: u32,
}

/// Path of the filter built for `wasm32-wasip1` with the `wasm` profile.
///
/// `INFERENCE_CACHE_FILTER_WASM` names a prebuilt file; otherwise the filter is
/// built (a no-op when fresh) with
/// `cargo build -p inference-cache-filter --target wasm32-wasip1 --profile wasm`
/// into `$CARGO_TARGET_DIR` (default `<repo>/target`).
pub fn filter_wasm() -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build_filter().map_err(|error| format!("{error:#}")))
        .clone()
        .map_err(|error| anyhow!(error))
}

/// The repository root (the workspace holding this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
}

fn build_filter() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("INFERENCE_CACHE_FILTER_WASM") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!(
                "INFERENCE_CACHE_FILTER_WASM={} does not exist",
                path.display()
            );
        }
        return Ok(path);
    }
    let root = repo_root();
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&root)
        .args([
            "build",
            "-p",
            "inference-cache-filter",
            "--target",
            "wasm32-wasip1",
            "--profile",
            "wasm",
        ])
        .env("CARGO_TARGET_DIR", &target_dir)
        .status()
        .context("running cargo to build the filter")?;
    if !status.success() {
        bail!(
            "building the filter failed; run `cargo build -p inference-cache-filter --target wasm32-wasip1 --profile wasm` (needs `rustup target add wasm32-wasip1`)"
        );
    }
    let path = target_dir.join("wasm32-wasip1/wasm/inference_cache_filter.wasm");
    if !path.is_file() {
        bail!("the filter build produced no {}", path.display());
    }
    Ok(path)
}

fn memory(caller: &mut Caller<'_, HostState>) -> wasmtime::Result<Memory> {
    match caller.get_export("memory") {
        Some(Extern::Memory(memory)) => Ok(memory),
        _ => wasmtime::bail!("the module exports no memory"),
    }
}

fn read(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> wasmtime::Result<Vec<u8>> {
    let memory = memory(caller)?;
    let start = ptr as u32 as usize;
    let end = start + len as u32 as usize;
    memory
        .data(&caller)
        .get(start..end)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| wasmtime::format_err!("guest pointer out of bounds"))
}

fn read_string(caller: &mut Caller<'_, HostState>, ptr: i32, len: i32) -> wasmtime::Result<String> {
    Ok(String::from_utf8_lossy(&read(caller, ptr, len)?).into_owned())
}

fn write(caller: &mut Caller<'_, HostState>, ptr: i32, bytes: &[u8]) -> wasmtime::Result<()> {
    let memory = memory(caller)?;
    memory
        .write(caller, ptr as u32 as usize, bytes)
        .map_err(|error| wasmtime::format_err!("guest write out of bounds: {error}"))
}

fn write_u32(caller: &mut Caller<'_, HostState>, ptr: i32, value: u32) -> wasmtime::Result<()> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Copies `bytes` into guest memory allocated by the guest; writes pointer and size.
fn give(
    caller: &mut Caller<'_, HostState>,
    bytes: &[u8],
    data_ptr: i32,
    size_ptr: i32,
) -> wasmtime::Result<()> {
    let allocate = caller
        .get_export("proxy_on_memory_allocate")
        .and_then(Extern::into_func)
        .ok_or_else(|| wasmtime::format_err!("the module exports no proxy_on_memory_allocate"))?
        .typed::<i32, i32>(&caller)?;
    let len = i32::try_from(bytes.len())?;
    let ptr = allocate.call(&mut *caller, len)?;
    write(caller, ptr, bytes)?;
    write_u32(caller, data_ptr, ptr as u32)?;
    write_u32(caller, size_ptr, len as u32)
}

fn link(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_log",
        |mut caller: Caller<'_, HostState>,
         level: i32,
         ptr: i32,
         len: i32|
         -> wasmtime::Result<i32> {
            let message = read_string(&mut caller, ptr, len)?;
            caller.data_mut().logs.push((level, message));
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_effective_context",
        |mut caller: Caller<'_, HostState>, context: i32| -> i32 {
            caller.data_mut().effective = context as u32;
            STATUS_OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_buffer_bytes",
        |mut caller: Caller<'_, HostState>,
         buffer: i32,
         start: i32,
         max: i32,
         data_ptr: i32,
         size_ptr: i32|
         -> wasmtime::Result<i32> {
            let state = caller.data_mut();
            let whole = match buffer {
                BUFFER_REQUEST_BODY => state.stream().request_body.clone(),
                BUFFER_GRPC_RECEIVE => state.grpc_receive.clone(),
                BUFFER_PLUGIN_CONFIGURATION => state.plugin_configuration.clone(),
                BUFFER_VM_CONFIGURATION => Vec::new(),
                _ => return Ok(STATUS_BAD_ARGUMENT),
            };
            let start = (start as u32 as usize).min(whole.len());
            let end = start.saturating_add(max as u32 as usize).min(whole.len());
            if start == end {
                return Ok(STATUS_NOT_FOUND);
            }
            give(&mut caller, &whole[start..end], data_ptr, size_ptr)?;
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_header_map_value",
        |mut caller: Caller<'_, HostState>,
         map_type: i32,
         key_ptr: i32,
         key_len: i32,
         data_ptr: i32,
         size_ptr: i32|
         -> wasmtime::Result<i32> {
            let key = read_string(&mut caller, key_ptr, key_len)?.to_ascii_lowercase();
            let Some(map) = caller.data_mut().map(map_type) else {
                return Ok(STATUS_BAD_ARGUMENT);
            };
            let Some(value) = map
                .iter()
                .find(|(name, _)| *name == key)
                .map(|(_, value)| value.clone())
            else {
                return Ok(STATUS_NOT_FOUND);
            };
            give(&mut caller, value.as_bytes(), data_ptr, size_ptr)?;
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_replace_header_map_value",
        |mut caller: Caller<'_, HostState>,
         map_type: i32,
         key_ptr: i32,
         key_len: i32,
         value_ptr: i32,
         value_len: i32|
         -> wasmtime::Result<i32> {
            let key = read_string(&mut caller, key_ptr, key_len)?.to_ascii_lowercase();
            let value = read_string(&mut caller, value_ptr, value_len)?;
            let Some(map) = caller.data_mut().map(map_type) else {
                return Ok(STATUS_BAD_ARGUMENT);
            };
            map.retain(|(name, _)| *name != key);
            map.push((key, value));
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_add_header_map_value",
        |mut caller: Caller<'_, HostState>,
         map_type: i32,
         key_ptr: i32,
         key_len: i32,
         value_ptr: i32,
         value_len: i32|
         -> wasmtime::Result<i32> {
            let key = read_string(&mut caller, key_ptr, key_len)?.to_ascii_lowercase();
            let value = read_string(&mut caller, value_ptr, value_len)?;
            let Some(map) = caller.data_mut().map(map_type) else {
                return Ok(STATUS_BAD_ARGUMENT);
            };
            map.push((key, value));
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_remove_header_map_value",
        |mut caller: Caller<'_, HostState>,
         map_type: i32,
         key_ptr: i32,
         key_len: i32|
         -> wasmtime::Result<i32> {
            let key = read_string(&mut caller, key_ptr, key_len)?.to_ascii_lowercase();
            let Some(map) = caller.data_mut().map(map_type) else {
                return Ok(STATUS_BAD_ARGUMENT);
            };
            map.retain(|(name, _)| *name != key);
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_property",
        |mut caller: Caller<'_, HostState>,
         path_ptr: i32,
         path_len: i32,
         data_ptr: i32,
         size_ptr: i32|
         -> wasmtime::Result<i32> {
            let path = property_key(&read(&mut caller, path_ptr, path_len)?);
            let Some(value) = caller.data_mut().stream().properties.get(&path).cloned() else {
                return Ok(STATUS_NOT_FOUND);
            };
            give(&mut caller, &value, data_ptr, size_ptr)?;
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |mut caller: Caller<'_, HostState>,
         path_ptr: i32,
         path_len: i32,
         value_ptr: i32,
         value_len: i32|
         -> wasmtime::Result<i32> {
            let path = property_key(&read(&mut caller, path_ptr, path_len)?);
            let value = read(&mut caller, value_ptr, value_len)?;
            caller.data_mut().stream().properties.insert(path, value);
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_continue_stream",
        |mut caller: Caller<'_, HostState>, _stream_type: i32| -> i32 {
            caller.data_mut().stream().resumed += 1;
            STATUS_OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_call",
        |mut caller: Caller<'_, HostState>,
         cluster_ptr: i32,
         cluster_len: i32,
         service_ptr: i32,
         service_len: i32,
         method_ptr: i32,
         method_len: i32,
         _metadata_ptr: i32,
         _metadata_len: i32,
         message_ptr: i32,
         message_len: i32,
         timeout_ms: i32,
         token_ptr: i32|
         -> wasmtime::Result<i32> {
            let cluster = read_string(&mut caller, cluster_ptr, cluster_len)?;
            let service = read_string(&mut caller, service_ptr, service_len)?;
            let method = read_string(&mut caller, method_ptr, method_len)?;
            let message = read(&mut caller, message_ptr, message_len)?;
            let state = caller.data_mut();
            if !state.clusters.contains(&cluster) {
                // Envoy answers an unknown cluster synchronously with ParseFailure.
                return Ok(STATUS_PARSE_FAILURE);
            }
            state.next_token += 1;
            let token = state.next_token;
            let context = state.effective;
            state.grpc_calls.push(GrpcCall {
                token,
                context,
                cluster,
                service,
                method,
                message,
                timeout_ms: timeout_ms as u32,
            });
            write_u32(&mut caller, token_ptr, token)?;
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut caller: Caller<'_, HostState>, period_ms: i32| -> i32 {
            caller.data_mut().tick_period_ms = period_ms as u32;
            STATUS_OK
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut caller: Caller<'_, HostState>,
         _metric_type: i32,
         name_ptr: i32,
         name_len: i32,
         id_ptr: i32|
         -> wasmtime::Result<i32> {
            let name = read_string(&mut caller, name_ptr, name_len)?;
            let state = caller.data_mut();
            let id = match state.metric_names.iter().position(|known| *known == name) {
                Some(id) => id,
                None => {
                    state.metric_names.push(name);
                    state.metric_values.push(0);
                    state.metric_names.len() - 1
                }
            };
            write_u32(&mut caller, id_ptr, u32::try_from(id)?)?;
            Ok(STATUS_OK)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |mut caller: Caller<'_, HostState>, id: i32, offset: i64| -> i32 {
            match caller.data_mut().metric_values.get_mut(id as u32 as usize) {
                Some(value) => {
                    *value += offset;
                    STATUS_OK
                }
                None => STATUS_NOT_FOUND,
            }
        },
    )?;
    link_wasi(linker)
}

/// The WASI preview-1 calls Rust's std may make from a proxy-wasm filter.
fn link_wasi(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    const WASI: &str = "wasi_snapshot_preview1";
    linker.func_wrap(
        WASI,
        "random_get",
        |mut caller: Caller<'_, HostState>, ptr: i32, len: i32| -> wasmtime::Result<i32> {
            // Deterministic bytes: only HashMap seeding asks for them.
            let bytes: Vec<u8> = (0..len as u32)
                .map(|index| (index * 31 + 7) as u8)
                .collect();
            write(&mut caller, ptr, &bytes)?;
            Ok(0)
        },
    )?;
    linker.func_wrap(
        WASI,
        "fd_write",
        |mut caller: Caller<'_, HostState>,
         _fd: i32,
         iovs: i32,
         iovs_len: i32,
         written_ptr: i32|
         -> wasmtime::Result<i32> {
            let mut total = 0u32;
            let mut text = Vec::new();
            for index in 0..iovs_len {
                let entry = read(&mut caller, iovs + index * 8, 8)?;
                let ptr = u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]);
                let len = u32::from_le_bytes([entry[4], entry[5], entry[6], entry[7]]);
                text.extend(read(&mut caller, ptr as i32, len as i32)?);
                total += len;
            }
            let message = String::from_utf8_lossy(&text).into_owned();
            caller.data_mut().logs.push((-1, message));
            write_u32(&mut caller, written_ptr, total)?;
            Ok(0)
        },
    )?;
    linker.func_wrap(
        WASI,
        "environ_sizes_get",
        |mut caller: Caller<'_, HostState>,
         count_ptr: i32,
         size_ptr: i32|
         -> wasmtime::Result<i32> {
            write_u32(&mut caller, count_ptr, 0)?;
            write_u32(&mut caller, size_ptr, 0)?;
            Ok(0)
        },
    )?;
    linker.func_wrap(
        WASI,
        "environ_get",
        |_caller: Caller<'_, HostState>, _environ: i32, _buffer: i32| -> i32 { 0 },
    )?;
    linker.func_wrap(
        WASI,
        "clock_time_get",
        |mut caller: Caller<'_, HostState>,
         _clock: i32,
         _precision: i64,
         time_ptr: i32|
         -> wasmtime::Result<i32> {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|elapsed| elapsed.as_nanos() as u64)
                .unwrap_or(0);
            write(&mut caller, time_ptr, &nanos.to_le_bytes())?;
            Ok(0)
        },
    )?;
    Ok(())
}

impl ProxyWasmHost {
    /// Compiles and instantiates the filter, and runs its `_initialize`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        static ENGINE: OnceLock<Engine> = OnceLock::new();
        let engine = ENGINE.get_or_init(Engine::default);
        let module = Module::from_file(engine, path)
            .map_err(host_error)
            .with_context(|| format!("compiling {}", path.display()))?;
        let mut linker = Linker::new(engine);
        link(&mut linker).map_err(host_error)?;
        linker
            .define_unknown_imports_as_traps(&module)
            .map_err(host_error)?;
        let mut store = Store::new(engine, HostState::default());
        let instance = linker
            .instantiate(&mut store, &module)
            .map_err(host_error)?;
        let mut host = Self {
            store,
            instance,
            next_context: ROOT_CONTEXT + 1,
        };
        if host
            .instance
            .get_func(&mut host.store, "_initialize")
            .is_some()
        {
            host.call::<(), ()>("_initialize", ())?;
        }
        Ok(host)
    }

    fn call<Params, Results>(&mut self, name: &str, params: Params) -> anyhow::Result<Results>
    where
        Params: wasmtime::WasmParams,
        Results: wasmtime::WasmResults,
    {
        let function = self
            .instance
            .get_typed_func::<Params, Results>(&mut self.store, name)
            .map_err(host_error)
            .with_context(|| format!("export {name}"))?;
        function
            .call(&mut self.store, params)
            .map_err(host_error)
            .with_context(|| format!("calling {name}"))
    }

    /// The timer period the filter asked for, in milliseconds (0: none).
    pub fn tick_period_ms(&self) -> u32 {
        self.store.data().tick_period_ms
    }

    /// Fires the root context's timer (`proxy_on_tick`).
    pub fn tick(&mut self) -> anyhow::Result<()> {
        self.store.data_mut().effective = ROOT_CONTEXT;
        self.call::<i32, ()>("proxy_on_tick", ROOT_CONTEXT as i32)
    }

    /// Declares an Envoy cluster name that gRPC calls may target.
    pub fn add_cluster(&mut self, name: &str) {
        self.store.data_mut().clusters.insert(name.to_owned());
    }

    /// Creates the root context and runs `on_vm_start` and `on_configure`; returns what
    /// `on_configure` returned (false: the plugin refuses to start).
    pub fn configure(&mut self, plugin_configuration: &str) -> anyhow::Result<bool> {
        let size = i32::try_from(plugin_configuration.len())?;
        self.store.data_mut().plugin_configuration = plugin_configuration.as_bytes().to_vec();
        self.store.data_mut().effective = ROOT_CONTEXT;
        self.call::<(i32, i32), ()>("proxy_on_context_create", (ROOT_CONTEXT as i32, 0))?;
        let started =
            self.call::<(i32, i32), i32>("proxy_on_vm_start", (ROOT_CONTEXT as i32, 0))?;
        if started == 0 {
            return Ok(false);
        }
        let configured =
            self.call::<(i32, i32), i32>("proxy_on_configure", (ROOT_CONTEXT as i32, size))?;
        Ok(configured != 0)
    }

    /// Creates an HTTP stream context with these request headers.
    pub fn new_stream(&mut self, headers: &[(&str, &str)]) -> anyhow::Result<u32> {
        let context = self.next_context;
        self.next_context += 1;
        let stream = Stream {
            request_headers: headers
                .iter()
                .map(|(name, value)| (name.to_ascii_lowercase(), (*value).to_owned()))
                .collect(),
            ..Stream::default()
        };
        self.store.data_mut().streams.insert(context, stream);
        self.store.data_mut().effective = context;
        self.call::<(i32, i32), ()>(
            "proxy_on_context_create",
            (context as i32, ROOT_CONTEXT as i32),
        )?;
        Ok(context)
    }

    fn enter(&mut self, context: u32) {
        self.store.data_mut().effective = context;
    }

    /// Delivers the request headers.
    pub fn request_headers(&mut self, context: u32, end_of_stream: bool) -> anyhow::Result<Action> {
        self.enter(context);
        let count = self
            .store
            .data()
            .streams
            .get(&context)
            .map_or(0, |stream| stream.request_headers.len());
        let action = self.call::<(i32, i32, i32), i32>(
            "proxy_on_request_headers",
            (
                context as i32,
                i32::try_from(count)?,
                i32::from(end_of_stream),
            ),
        )?;
        action_of(action)
    }

    /// Appends a body chunk and delivers the body callback with the total size.
    pub fn request_body(
        &mut self,
        context: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> anyhow::Result<Action> {
        self.enter(context);
        let stream = self.store.data_mut().stream();
        stream.request_body.extend_from_slice(chunk);
        let size = i32::try_from(stream.request_body.len())?;
        let action = self.call::<(i32, i32, i32), i32>(
            "proxy_on_request_body",
            (context as i32, size, i32::from(end_of_stream)),
        )?;
        action_of(action)
    }

    /// Delivers the response headers.
    pub fn response_headers(
        &mut self,
        context: u32,
        end_of_stream: bool,
    ) -> anyhow::Result<Action> {
        self.enter(context);
        let action = self.call::<(i32, i32, i32), i32>(
            "proxy_on_response_headers",
            (context as i32, 0, i32::from(end_of_stream)),
        )?;
        action_of(action)
    }

    /// Every gRPC call made so far.
    pub fn grpc_calls(&self) -> &[GrpcCall] {
        &self.store.data().grpc_calls
    }

    /// Answers a gRPC call with a response message (status OK).
    pub fn grpc_success(&mut self, token: u32, message: &[u8]) -> anyhow::Result<()> {
        self.store.data_mut().grpc_receive = message.to_vec();
        self.enter(ROOT_CONTEXT);
        self.call::<(i32, i32, i32), ()>(
            "proxy_on_grpc_receive",
            (
                ROOT_CONTEXT as i32,
                token as i32,
                i32::try_from(message.len())?,
            ),
        )?;
        self.store.data_mut().grpc_receive.clear();
        Ok(())
    }

    /// Ends a gRPC call with a non-zero status.
    pub fn grpc_failure(&mut self, token: u32, status: u32) -> anyhow::Result<()> {
        self.enter(ROOT_CONTEXT);
        self.call::<(i32, i32, i32), ()>(
            "proxy_on_grpc_close",
            (ROOT_CONTEXT as i32, token as i32, status as i32),
        )
    }

    /// Ends a stream: `on_done`, `on_log`, `on_delete`.
    pub fn finish(&mut self, context: u32) -> anyhow::Result<()> {
        self.enter(context);
        self.call::<i32, i32>("proxy_on_done", context as i32)?;
        self.call::<i32, ()>("proxy_on_log", context as i32)?;
        self.call::<i32, ()>("proxy_on_delete", context as i32)?;
        self.store.data_mut().streams.remove(&context);
        Ok(())
    }

    /// A request header of a stream, as the filter left it.
    pub fn request_header(&self, context: u32, name: &str) -> Option<String> {
        header(
            self.store
                .data()
                .streams
                .get(&context)?
                .request_headers
                .as_slice(),
            name,
        )
    }

    /// A response header of a stream, as the filter left it.
    pub fn response_header(&self, context: u32, name: &str) -> Option<String> {
        header(
            self.store
                .data()
                .streams
                .get(&context)?
                .response_headers
                .as_slice(),
            name,
        )
    }

    /// Seeds a property of a stream (route metadata, dynamic metadata, filter state).
    pub fn set_property(&mut self, context: u32, path: &[&str], value: &[u8]) {
        if let Some(stream) = self.store.data_mut().streams.get_mut(&context) {
            stream.properties.insert(path.join("."), value.to_vec());
        }
    }

    /// A property of a stream, as the filter left it.
    pub fn property(&self, context: u32, path: &[&str]) -> Option<Vec<u8>> {
        self.store
            .data()
            .streams
            .get(&context)?
            .properties
            .get(&path.join("."))
            .cloned()
    }

    /// Adds a response header as an upstream would, before the filter sees the response.
    pub fn add_upstream_response_header(&mut self, context: u32, name: &str, value: &str) {
        if let Some(stream) = self.store.data_mut().streams.get_mut(&context) {
            stream
                .response_headers
                .push((name.to_ascii_lowercase(), value.to_owned()));
        }
    }

    /// How many times the filter resumed the stream's request.
    pub fn resumed(&self, context: u32) -> u32 {
        self.store
            .data()
            .streams
            .get(&context)
            .map_or(0, |stream| stream.resumed)
    }

    /// A counter's value, if the filter defined it.
    pub fn metric(&self, name: &str) -> Option<i64> {
        let state = self.store.data();
        let id = state.metric_names.iter().position(|known| known == name)?;
        state.metric_values.get(id).copied()
    }

    /// Every log line (level, message); level -1 is WASI stdout/stderr.
    pub fn logs(&self) -> &[(i32, String)] {
        &self.store.data().logs
    }
}

/// A wasmtime error (traps included) as an `anyhow` error, keeping its details.
fn host_error(error: wasmtime::Error) -> anyhow::Error {
    anyhow!("{error:?}")
}

/// A serialized property path (parts separated by NUL) as the parts joined with '.'.
fn property_key(serialized: &[u8]) -> String {
    serialized
        .split(|byte| *byte == 0)
        .map(String::from_utf8_lossy)
        .collect::<Vec<_>>()
        .join(".")
}

fn header(headers: &[(String, String)], name: &str) -> Option<String> {
    headers
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.clone())
}

fn action_of(value: i32) -> anyhow::Result<Action> {
    match value {
        0 => Ok(Action::Continue),
        1 => Ok(Action::Pause),
        other => bail!("unknown action {other}"),
    }
}
