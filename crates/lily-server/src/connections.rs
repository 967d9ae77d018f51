//! Accepting connections with limits, so slow or idle clients cannot exhaust the server: at most
//! `max_connections` at once (more are answered 503 and closed at once, never queued on a file
//! descriptor), a deadline for each request's headers (which also ends a keep-alive connection
//! left idle that long), and a number of requests per keep-alive connection. The body's deadline
//! is the router's (`routes::read_body`), which can answer it with an error object.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue, Request, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// What a client may hold of the server.
#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    /// Open connections at once.
    pub max_connections: usize,
    /// Time to send a request's headers, from the connection's start or the previous response.
    pub header_timeout: Duration,
    /// Requests served on one connection before it is closed (1: no keep-alive).
    pub keep_alive_requests: usize,
}

/// Refusals being written at once; past this, a connection over the limit is just closed.
const MAX_REFUSING: usize = 64;

/// Serves `app` on `listener` until `shutdown` completes, then waits for open connections to
/// finish their current request (the caller bounds how long).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(limits.keep_alive_requests > 1);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors (or a connection reset before it was taken): wait
                    // for some to be released rather than spin.
                    tracing::warn!("accept error: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if let Ok(turn) = refusing.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream, limits.max_connections).await;
                    drop(turn);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = Counted {
            inner: TowerToHyperService::new(app.clone()),
            served: AtomicUsize::new(0),
            limit: limits.keep_alive_requests,
        };
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // Errors here are the client's (a header deadline missed, a reset): nothing to answer.
            if let Err(e) = connection.await {
                tracing::debug!("connection closed: {e}");
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// The answer to a connection over the limit, written without reading the request (there is no
/// slot to parse it in): a 503 error object, then the connection is closed.
async fn refuse(mut stream: TcpStream, limit: usize) {
    let body = crate::openai::error::ApiError::unavailable(format!(
        "the server has {limit} connections open, its limit; retry later"
    ))
    .body()
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sent until it closes, so closing does not reset the connection
        // before the client has read the answer.
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// The router, counting the requests of one connection: the last one allowed is answered with
/// `Connection: close`, which makes hyper close the connection after it.
struct Counted {
    inner: TowerToHyperService<Router>,
    served: AtomicUsize,
    limit: usize,
}

type Answer = Pin<Box<dyn Future<Output = Result<Response<axum::body::Body>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for Counted {
    type Response = Response<axum::body::Body>;
    type Error = Infallible;
    type Future = Answer;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let n = self.served.fetch_add(1, Ordering::Relaxed) + 1;
        let last = n >= self.limit;
        let answer = self.inner.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            if last {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok(response)
        })
    }
}
