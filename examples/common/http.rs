//! The bit of hand-written HTTP/1.1 the load tools' upstreams share: reading
//! one request. (Not an example of its own: examples/ builds only the files
//! at its top level.)

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::TcpStream;

/// Reads one request from `socket` and gives its target (`/path?query`);
/// its body (`Content-Length` only: the tools' clients send nothing else)
/// is read and dropped. `None` when the connection ended first.
pub async fn read_request(
    socket: &mut BufReader<TcpStream>,
) -> Result<Option<String>, Box<dyn std::error::Error + Send + Sync>> {
    let mut line = String::new();
    if socket.read_line(&mut line).await? == 0 {
        return Ok(None);
    }
    let target = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
    let mut content_length = 0usize;
    loop {
        line.clear();
        if socket.read_line(&mut line).await? == 0 {
            return Ok(None);
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            content_length = value.trim().parse()?;
        }
    }
    let mut body = vec![0u8; content_length];
    socket.read_exact(&mut body).await?;
    Ok(Some(target))
}
