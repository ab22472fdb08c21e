//! HTTP/1.1 to the server with hyper's own client connection, over TCP or
//! a Unix socket through one code path (`TokioIo` over either stream). One
//! connection per request: a CLI makes few, and a long poll or a stream
//! then never holds up another request.

use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use hyper::body::{Body as _, Bytes, Incoming};
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncWrite};

use super::error::CliError;
use super::url::BaseUrl;

/// 503 answers (`busy`, `unavailable`) are tried again this many times.
const RETRIES: u32 = 3;
/// Longest pause between two tries, whatever Retry-After says.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Tcp(BaseUrl),
    Unix(PathBuf),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(url) => write!(f, "http://{}{}", url.authority, url.prefix),
            Endpoint::Unix(path) => write!(f, "the Unix socket {}", path.display()),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Endpoint,
    token: Option<String>,
}

/// A whole answer.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, CliError> {
        serde_json::from_slice(&self.body)
            .map_err(|e| CliError::local(format!("the server's answer does not parse: {e}")))
    }

    /// The body as the server sent it, for `--json`.
    pub fn print_raw(&self) -> Result<(), CliError> {
        super::table::print_json_text(&String::from_utf8_lossy(&self.body))
    }
}

impl Client {
    pub fn new(endpoint: Endpoint, token: Option<String>) -> Self {
        Self { endpoint, token }
    }

    pub fn over_unix_socket(&self) -> bool {
        matches!(self.endpoint, Endpoint::Unix(_))
    }

    pub async fn get(&self, path: &str) -> Result<Answer, CliError> {
        self.call(Method::GET, path, None).await
    }

    pub async fn post<B: Serialize>(&self, path: &str, body: &B) -> Result<Answer, CliError> {
        let body = serde_json::to_string(body)
            .map_err(|e| CliError::local(format!("cannot encode the request: {e}")))?;
        self.call(Method::POST, path, Some(body)).await
    }

    /// A request, tried again on 503 after the Retry-After the server
    /// asked for (POSTs carry one Idempotency-Key across the tries, so the
    /// server may answer a repeat from what it stored). Ok only on 2xx.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<String>,
    ) -> Result<Answer, CliError> {
        let key = (method == Method::POST).then(|| uuid::Uuid::now_v7().to_string());
        let mut tries = 0;
        loop {
            let mut extra = Vec::new();
            if let Some(key) = &key {
                extra.push(("idempotency-key", key.clone()));
            }
            let res = self
                .open(method.clone(), path, body.clone(), &extra)
                .await?;
            let (parts, incoming) = res.into_parts();
            let body_bytes = read_all(incoming).await.map_err(|e| {
                CliError::unreachable(format!("reading the answer from {}: {e}", self.endpoint))
            })?;
            let answer = Answer {
                status: parts.status,
                headers: parts.headers,
                body: body_bytes,
            };
            if answer.status == StatusCode::SERVICE_UNAVAILABLE && tries < RETRIES {
                tries += 1;
                tokio::time::sleep(retry_after(&answer.headers)).await;
                continue;
            }
            if answer.status.is_success() {
                return Ok(answer);
            }
            return Err(CliError::api(answer.status.as_u16(), &answer.body));
        }
    }

    /// One request, once; the body is left to the caller to read (streams).
    pub async fn open(
        &self,
        method: Method,
        path: &str,
        body: Option<String>,
        extra: &[(&'static str, String)],
    ) -> Result<Response<Incoming>, CliError> {
        let (host, prefix) = match &self.endpoint {
            Endpoint::Tcp(url) => (url.authority.as_str(), url.prefix.as_str()),
            Endpoint::Unix(_) => ("localhost", ""),
        };
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{prefix}{path}"))
            .header(header::HOST, host)
            .header(
                header::USER_AGENT,
                concat!("holdfast/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(token) = &self.token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        for (name, value) in extra {
            req = req.header(*name, value);
        }
        let req = req
            .body(body.unwrap_or_default())
            .map_err(|e| CliError::local(format!("cannot build the request for {path}: {e}")))?;
        let mut sender = self.connect().await?;
        sender
            .send_request(req)
            .await
            .map_err(|e| CliError::unreachable(format!("{} did not answer: {e}", self.endpoint)))
    }

    async fn connect(&self) -> Result<SendRequest<String>, CliError> {
        let unreachable = |e: &dyn std::fmt::Display| {
            CliError::unreachable(format!("cannot connect to {}: {e}", self.endpoint))
        };
        let connected = tokio::time::timeout(CONNECT_TIMEOUT, async {
            match &self.endpoint {
                Endpoint::Tcp(url) => {
                    let stream = tokio::net::TcpStream::connect(url.address()).await?;
                    let _ = stream.set_nodelay(true);
                    handshake(stream).await
                }
                Endpoint::Unix(path) => {
                    handshake(tokio::net::UnixStream::connect(path).await?).await
                }
            }
        })
        .await;
        match connected {
            Ok(Ok(sender)) => Ok(sender),
            Ok(Err(e)) => Err(unreachable(&e)),
            Err(_) => Err(unreachable(&"timed out")),
        }
    }
}

async fn handshake<S>(stream: S) -> std::io::Result<SendRequest<String>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        // Errors surface on the request that was in flight.
        let _ = conn.await;
    });
    Ok(sender)
}

fn retry_after(headers: &HeaderMap) -> Duration {
    headers
        .get(header::RETRY_AFTER)
        .and_then(|v: &HeaderValue| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(Duration::from_secs(1), Duration::from_secs)
        .min(MAX_RETRY_AFTER)
}

/// A streamed answer that is not a 2xx, read whole and made the error it says.
pub async fn success(res: Response<Incoming>) -> Result<Response<Incoming>, CliError> {
    if res.status().is_success() {
        return Ok(res);
    }
    let status = res.status().as_u16();
    let body = read_all(res.into_body()).await.unwrap_or_default();
    Err(CliError::api(status, &body))
}

/// The next piece of a body as it arrives; None at its end.
pub async fn next_chunk(body: &mut Incoming) -> Result<Option<Bytes>, hyper::Error> {
    loop {
        let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await;
        match frame {
            None => return Ok(None),
            Some(frame) => {
                if let Ok(data) = frame?.into_data() {
                    return Ok(Some(data));
                }
            }
        }
    }
}

async fn read_all(mut body: Incoming) -> Result<Bytes, hyper::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = next_chunk(&mut body).await? {
        out.extend_from_slice(&chunk);
    }
    Ok(out.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_bounded() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h), Duration::from_secs(1));
        h.insert(header::RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(retry_after(&h), Duration::from_secs(3));
        h.insert(header::RETRY_AFTER, HeaderValue::from_static("3600"));
        assert_eq!(retry_after(&h), MAX_RETRY_AFTER);
    }
}
