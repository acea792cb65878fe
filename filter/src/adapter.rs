//! The proxy-wasm 0.2.5 (ABI 0.2.1) adapter: SDK callbacks in, [`RequestFlow`] out.
//!
//! The root context parses the plugin configuration in `on_configure` and
//! returns `false` on error (Envoy then refuses the plugin), after logging the
//! field at fault. It defines every counter once and hands each HTTP context
//! an `Rc` of the settings and metric ids (counters and histograms). Each HTTP context implements
//! [`Host`] with proxy-wasm host calls; header values are read as bytes so
//! non-UTF-8 request data can never panic. Nothing here decides anything.
//!
//! The root context also owns the worker's [`OutcomeReporter`]: HTTP
//! contexts push measured outcomes into the shared buffer, and the timer
//! tick (every `outcome_flush_ms`; none when it is 0) sends them.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{self, BufferType, ContextType, MapType, MetricType};

use crate::{
    Action, DispatchError, Host, LogLevel, OutcomeBuffer, OutcomeReporter, ReportHost, RequestFlow,
    Settings, SharedBuffer, all_histograms, all_metrics,
};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FilterRoot::default()) });
}}

type MetricIds = Rc<RefCell<HashMap<&'static str, u32>>>;

#[derive(Default)]
struct FilterRoot {
    settings: Option<Rc<Settings>>,
    metrics: MetricIds,
    outcomes: Option<SharedBuffer>,
    reporter: Option<OutcomeReporter>,
}

impl Context for FilterRoot {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, _response_size: usize) {
        let mut host = EnvoyHost {
            metrics: self.metrics.clone(),
        };
        if let Some(reporter) = &mut self.reporter {
            reporter.on_response(&mut host, token_id, status_code);
        }
    }
}

impl RootContext for FilterRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        match Settings::from_json(&bytes) {
            Ok(settings) => {
                let mut ids = self.metrics.borrow_mut();
                for name in all_metrics() {
                    if let Ok(id) = hostcalls::define_metric(MetricType::Counter, name) {
                        ids.insert(name, id);
                    }
                }
                for name in all_histograms() {
                    if let Ok(id) = hostcalls::define_metric(MetricType::Histogram, name) {
                        ids.insert(name, id);
                    }
                }
                log(
                    LogLevel::Info,
                    &format!(
                        "inference-cache filter configured: cluster `{}`, authority `{}`, timeout {} ms",
                        settings.grpc_cluster,
                        settings
                            .grpc_authority
                            .as_deref()
                            .unwrap_or("(the cluster name)"),
                        settings.timeout.as_millis()
                    ),
                );
                let settings = Rc::new(settings);
                if settings.outcome_flush.is_zero() {
                    self.outcomes = None;
                    self.reporter = None;
                } else {
                    let buffer = Rc::new(RefCell::new(OutcomeBuffer::new(
                        settings.outcome_buffer_max,
                    )));
                    self.reporter = Some(OutcomeReporter::new(
                        Rc::clone(&settings),
                        Rc::clone(&buffer),
                    ));
                    self.outcomes = Some(buffer);
                    self.set_tick_period(settings.outcome_flush);
                }
                self.settings = Some(settings);
                true
            }
            Err(error) => {
                let _ = hostcalls::log(
                    types::LogLevel::Error,
                    &format!("inference-cache filter: {error}"),
                );
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let mut host = EnvoyHost {
            metrics: self.metrics.clone(),
        };
        if let Some(reporter) = &mut self.reporter {
            reporter.on_tick(&mut host);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let settings = self.settings.clone()?;
        let mut flow = RequestFlow::new(settings);
        if let Some(buffer) = &self.outcomes {
            flow = flow.with_outcome_sink(Rc::clone(buffer));
        }
        Some(Box::new(FilterStream {
            flow,
            host: EnvoyHost {
                metrics: self.metrics.clone(),
            },
            body_size: 0,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct FilterStream {
    flow: RequestFlow,
    host: EnvoyHost,
    body_size: usize,
}

impl Context for FilterStream {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        self.flow
            .on_lookup_response(&mut self.host, token_id, status_code, response_size);
    }
}

impl HttpContext for FilterStream {
    fn on_http_request_headers(
        &mut self,
        _num_headers: usize,
        end_of_stream: bool,
    ) -> types::Action {
        sdk_action(self.flow.on_request_headers(&mut self.host, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> types::Action {
        self.body_size = body_size;
        sdk_action(
            self.flow
                .on_request_body(&mut self.host, body_size, end_of_stream),
        )
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> types::Action {
        sdk_action(
            self.flow
                .on_request_trailers(&mut self.host, self.body_size),
        )
    }

    fn on_http_response_headers(
        &mut self,
        _num_headers: usize,
        _end_of_stream: bool,
    ) -> types::Action {
        sdk_action(self.flow.on_response_headers(&mut self.host))
    }

    // The flow always continues response chunks, so the host's body buffer
    // holds only the current chunk: `body_size` bytes of it.
    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> types::Action {
        sdk_action(
            self.flow
                .on_response_body(&mut self.host, body_size, end_of_stream),
        )
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> types::Action {
        sdk_action(self.flow.on_response_trailers(&mut self.host))
    }
}

fn sdk_action(action: Action) -> types::Action {
    match action {
        Action::Continue => types::Action::Continue,
        Action::Pause => types::Action::Pause,
    }
}

fn log(level: LogLevel, message: &str) {
    let level = match level {
        LogLevel::Debug => types::LogLevel::Debug,
        LogLevel::Info => types::LogLevel::Info,
        LogLevel::Warn => types::LogLevel::Warn,
    };
    let _ = hostcalls::log(level, message);
}

/// [`Host`] over proxy-wasm host calls, for the current HTTP context.
struct EnvoyHost {
    metrics: MetricIds,
}

impl Host for EnvoyHost {
    fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
    }

    fn remove_request_header(&mut self, name: &str) {
        let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name);
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
    }

    fn dispatch_grpc(
        &mut self,
        upstream: &str,
        service: &str,
        method: &str,
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, DispatchError> {
        hostcalls::dispatch_grpc_call(
            upstream,
            service,
            method,
            Vec::new(),
            Some(message),
            timeout,
        )
        .map_err(|_| DispatchError)
    }

    fn grpc_response_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size)
            .ok()
            .flatten()
    }

    fn resume_request(&mut self) {
        let _ = hostcalls::resume_http_request();
    }

    fn add_response_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
    }

    fn remove_response_header(&mut self, name: &str) {
        let _ = hostcalls::remove_map_value(MapType::HttpResponseHeaders, name);
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }

    fn set_property(&mut self, path: &[&str], value: &[u8]) {
        let _ = hostcalls::set_property(path.to_vec(), Some(value));
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
            .ok()
            .flatten()
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
            .ok()
            .flatten()
    }

    fn record_histogram(&mut self, name: &'static str, value: u64) {
        let id = self.metrics.borrow().get(name).copied();
        if let Some(id) = id {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn increment_counter(&mut self, name: &'static str) {
        let id = self.metrics.borrow().get(name).copied();
        if let Some(id) = id {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    fn log(&self, level: LogLevel, message: &str) {
        log(level, message);
    }
}

impl ReportHost for EnvoyHost {
    fn dispatch_grpc(
        &mut self,
        upstream: &str,
        service: &str,
        method: &str,
        message: &[u8],
        timeout: Duration,
    ) -> Result<u32, DispatchError> {
        Host::dispatch_grpc(self, upstream, service, method, message, timeout)
    }

    fn add_counter(&mut self, name: &'static str, amount: u64) {
        let id = self.metrics.borrow().get(name).copied();
        if let (Some(id), Ok(amount)) = (id, i64::try_from(amount)) {
            let _ = hostcalls::increment_metric(id, amount);
        }
    }

    fn log(&self, level: LogLevel, message: &str) {
        log(level, message);
    }
}
