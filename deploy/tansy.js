// njs (Debian's libnginx-mod-http-js) for the tansy balancer: nginx itself cannot read a JSON body,
// and it ends a stream whose replica died by closing the connection with nothing said.

// The conversation key of a request: a header the client sets, or else the OpenAI fields meant
// for it, at the top level of the JSON body. An empty key: none.
function conversationKey(r) {
  var h = r.headersIn['X-Conversation-Id'] || r.headersIn['X-Session-Id'];
  if (h) return h;
  if (r.method !== 'POST') return '';
  var body;
  try {
    // The whole body: nginx.conf keeps it in one memory buffer (njs throws for one in a file).
    var text = r.requestText;
    if (!text) return '';
    body = JSON.parse(text);
  } catch (e) {
    return '';  // a malformed body: the replica answers it with its own 400
  }
  if (body === null || typeof body !== 'object' || Array.isArray(body)) return '';
  var fields = ['prompt_cache_key', 'user'];
  for (var i = 0; i < fields.length; i++) {
    var v = body[fields[i]];
    if (typeof v === 'string' && v !== '') return v;
  }
  // Anthropic's Messages API names the end user here.
  var m = body.metadata;
  if (m !== null && typeof m === 'object' && typeof m.user_id === 'string' && m.user_id !== '')
    return m.user_id;
  return '';
}

// js_content of every client request: njs has read the body by now, so the key can pick the
// upstream group (one balancing method per group: consistent hashing or least connections).
function route(r) {
  var key = conversationKey(r);
  r.variables.tansy_key = key;
  r.internalRedirect(key ? '@keyed' : '@any');
}

// The event that ends a cut stream, in the stream's own API.
function cutEvent(r, uri) {
  var msg = 'the tansy replica serving this stream stopped before the response was complete ' +
      '(the text so far is truncated); retry the request';
  if (uri.indexOf('/v1/messages') === 0)
    return 'event: error\ndata: ' +
        JSON.stringify({type: 'error', error: {type: 'api_error', message: msg}}) + '\n\n';
  if (uri.indexOf('/v1/responses') === 0) {
    var e = {type: 'error', code: 'replica_failed', message: msg, param: null};
    if (r.variables.tansy_seq !== '') e.sequence_number = Number(r.variables.tansy_seq) + 1;
    return 'event: error\ndata: ' + JSON.stringify(e) + '\n\n';
  }
  return 'data: ' +
      JSON.stringify({error: {message: msg, type: 'server_error', param: null, code: 'replica_failed'}}) +
      '\n\ndata: [DONE]\n\n';
}

// Body filter of proxied responses. When the replica's connection ends before its last chunk
// (it died or timed out), nginx finalizes the request by passing one empty, non-last buffer down
// the filters and then closing the client's connection; it does so only after recording the
// upstream's response time, which is still "-" for the empty buffer that can open a response.
// An event stream cut so ends with an error event and a complete chunked body instead.
function cut(r, data, flags) {
  if (data.length === 0 && !flags.last && upstreamFinished(r) && isEventStream(r)) {
    r.error('tansy: stream cut by its replica (' + r.variables.upstream_addr + '): sent the client an error event');
    r.sendBuffer(cutEvent(r, r.uri), {last: true, flush: true});
    return;
  }
  if (data.length > 0 && r.uri.indexOf('/v1/responses') === 0 && isEventStream(r)) noteSequence(r, data);
  r.sendBuffer(data, flags);
}

// The Responses API numbers its events: the last number sent, so that a cut event follows it
// (an event split across two buffers may leave the number of the one before).
function noteSequence(r, data) {
  var re = /"sequence_number":(\d+)/g, m, last = null;
  while ((m = re.exec(data)) !== null) last = m[1];
  if (last !== null) r.variables.tansy_seq = last;
}

function isEventStream(r) {
  var t = r.headersOut['Content-Type'];
  return typeof t === 'string' && t.indexOf('text/event-stream') === 0;
}

function upstreamFinished(r) {
  var t = r.variables.upstream_response_time;  // "0.012, 0.240" after retries: the last is this one
  if (!t) return false;
  var parts = t.split(/[,:]\s*/);
  return parts[parts.length - 1].trim() !== '-';
}

export default {route, cut};
