//! The tests' plain HTTP/1.1 client: one `GET` with `Connection: close`,
//! the response read to the end and split into status and body (a chunked
//! body decoded). For the admin listener, the subscriber's `/metrics` and
//! the like; the keep-alive client of the Envoy tests is
//! `proxy_wasm_host_envoy::HttpClient`.
//!
//! This crate exports it as `inference_cache_tests::http`; the test harnesses
//! of other crates include this file with `#[path]`, so it needs nothing but
//! std and tokio.

// A harness that includes this file uses some of it.
#![allow(dead_code)]

/// Status and body of an HTTP response (the default: none, status 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpResponse {
    /// HTTP status code (0 when the status line has none).
    pub status: u16,
    /// The status line, e.g. `HTTP/1.1 503 Service Unavailable`.
    pub status_line: String,
    /// The header lines, as sent.
    pub head: String,
    /// The body, read to the end (the request closes the connection).
    pub body: String,
}

impl HttpResponse {
    /// Parses a whole response.
    pub fn parse(raw: &[u8]) -> Self {
        let text = String::from_utf8_lossy(raw);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status_line = head.lines().next().unwrap_or_default().to_owned();
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0);
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        let body = if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        };
        Self {
            status,
            status_line,
            head: head.to_owned(),
            body,
        }
    }
}

fn request(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
}

/// `GET path` on `addr`.
pub async fn get(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
) -> std::io::Result<HttpResponse> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request(path).as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    Ok(HttpResponse::parse(&raw))
}

/// `GET path` on `addr`, blocking the thread (for tests without a runtime).
pub fn get_blocking(
    addr: impl std::net::ToSocketAddrs,
    path: &str,
) -> std::io::Result<HttpResponse> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.write_all(request(path).as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    Ok(HttpResponse::parse(&raw))
}

/// Decodes a chunked transfer-encoded body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_status_head_and_a_chunked_body() {
        use super::HttpResponse;
        let plain = HttpResponse::parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        assert_eq!(plain.status, 200);
        assert_eq!(plain.status_line, "HTTP/1.1 200 OK");
        assert_eq!(plain.body, "ok");
        let chunked = HttpResponse::parse(
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nnot\r\n6\r\n ready\r\n0\r\n\r\n",
        );
        assert_eq!(chunked.status, 503);
        assert_eq!(chunked.body, "not ready");
        assert_eq!(HttpResponse::parse(b"").status, 0);
    }
}
