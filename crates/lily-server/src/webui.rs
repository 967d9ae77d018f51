//! The chat page (issue 33): the static files of `web/`, compiled into the binary and served at `/`
//! by `lily-engine serve` unless `--no-webui`. The page talks to `/v1/chat/completions` like any
//! other client (same API key, same queue); serving it is a lookup in a table of constant bytes,
//! so a server nobody browses pays nothing for it.
//!
//! Every file goes out with a Content-Security-Policy that allows only this origin's own scripts,
//! styles and connections (no inline script, no other host), and `nosniff`: even if the page's
//! own escaping failed, markup in a model's answer could neither run script nor reach elsewhere.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The policy every file of the page is served with. `'self'` everywhere it matters; objects,
/// `<base>`, form posts and framing by other sites are off.
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
    style-src 'self'; img-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

const HTML: &str = "text/html; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const SVG: &str = "image/svg+xml";

/// The page's files: where each is served, its type, its bytes.
const ASSETS: &[(&str, &str, &[u8])] = &[
    ("/", HTML, include_bytes!("../web/index.html")),
    ("/app.js", JS, include_bytes!("../web/app.js")),
    ("/markdown.js", JS, include_bytes!("../web/markdown.js")),
    ("/style.css", CSS, include_bytes!("../web/style.css")),
    ("/favicon.svg", SVG, include_bytes!("../web/favicon.svg")),
];

/// The page's routes, to merge into the API's router (GET, and HEAD with it).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    ASSETS
        .iter()
        .fold(Router::new(), |router, &(path, content_type, body)| {
            router.route(path, get(move || async move { serve(content_type, body) }))
        })
}

fn serve(content_type: &'static str, body: &'static [u8]) -> Response {
    let headers = [
        (header::CONTENT_TYPE, content_type),
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
        // A few small files, fetched anew on each load: a new binary's page shows at once.
        (header::CACHE_CONTROL, "no-cache"),
    ];
    let mut response = body.into_response();
    for (name, value) in headers {
        response
            .headers_mut()
            .insert(name, HeaderValue::from_static(value));
    }
    response
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, RwLock};
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::metrics::Metrics;
    use crate::state::{AppState, Phase};

    /// `GET path` against the whole router (API key set), over a real socket; the raw response.
    async fn get(webui: bool, path: &str) -> String {
        let state = Arc::new(AppState {
            model_id: "m".into(),
            api_key: Some("sekrit".into()),
            phase: RwLock::new(Phase::Loading("test")),
            metrics: Arc::new(Metrics::default()),
            created: 0,
            body_timeout: Duration::from_secs(5),
        });
        let app = crate::routes::router(state, webui);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        socket.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        socket.read_to_end(&mut response).await.unwrap();
        server.abort();
        String::from_utf8(response).unwrap()
    }

    fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
        let head = response.split("\r\n\r\n").next()?;
        head.lines().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    #[tokio::test]
    async fn the_page_is_served_without_the_key_with_a_restrictive_policy() {
        let page = get(true, "/").await;
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(page.contains("<script src=\"/app.js\""), "{page}");
        assert_eq!(
            header(&page, "content-type"),
            Some("text/html; charset=utf-8")
        );
        assert_eq!(header(&page, "x-content-type-options"), Some("nosniff"));
        let csp = header(&page, "content-security-policy").unwrap();
        for directive in [
            "default-src 'self'",
            "script-src 'self'",
            "connect-src 'self'",
        ] {
            assert!(csp.contains(directive), "{csp}");
        }
        assert!(!csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"));
        let script = get(true, "/app.js").await;
        assert!(script.starts_with("HTTP/1.1 200"), "{script}");
        assert_eq!(
            header(&script, "content-type"),
            Some("text/javascript; charset=utf-8")
        );
        assert_eq!(header(&script, "x-content-type-options"), Some("nosniff"));
        // The API behind it still wants the key.
        assert!(get(true, "/v1/models").await.starts_with("HTTP/1.1 401"));
    }

    #[tokio::test]
    async fn no_webui_leaves_only_the_api() {
        for path in ["/", "/app.js", "/style.css"] {
            let response = get(false, path).await;
            assert!(response.starts_with("HTTP/1.1 404"), "{path}: {response}");
            assert!(response.contains("\"code\":\"not_found\""), "{response}");
        }
        assert!(get(false, "/health").await.starts_with("HTTP/1.1 503"));
    }

    #[test]
    fn the_page_has_no_inline_script_or_style() {
        let html = std::str::from_utf8(super::ASSETS[0].2).unwrap();
        assert!(!html.contains("<script>") && !html.contains("style="));
        // No event-handler attributes (` onclick=`, ` oninput=`, ...): CSP would refuse them.
        let handler = html.match_indices(" on").any(|(at, _)| {
            let rest = &html[at + 3..];
            let name = rest.len()
                - rest
                    .trim_start_matches(|c: char| c.is_ascii_lowercase())
                    .len();
            name > 0 && rest[name..].starts_with('=')
        });
        assert!(!handler, "an inline event handler in index.html");
        assert!(!html.contains("http://") && !html.contains("https://"));
    }
}
