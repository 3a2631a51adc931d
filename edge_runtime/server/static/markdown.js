// A small markdown renderer for model answers, safe by construction: it builds the DOM with createElement
// and text nodes only, so nothing the model writes is ever parsed as HTML (a "<script>" in an answer is
// shown as those characters), and a link keeps its href only when it is http:, https: or mailto: (any
// other, javascript: included, is shown as plain text).
//
// Every text node it makes is a range [start, end) of the source string, handed to `text(start, end,
// parent)`: the page uses that to colour each range by the source (device, cloud, cache) that wrote it and
// to place hand-off markers at their offsets. Blocks: fenced code (``` or ~~~, an unclosed fence runs to
// the end, as while it streams), headings, lists, block quotes, rules and paragraphs (their newlines kept).
// Inline: `code`, **strong**, *em* / _em_, [text](url).
"use strict";

const SAFE_URL = /^(https?:\/\/|mailto:)/i;
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const BLOCKS = [
  ["hr", /^ {0,3}([-*_])(?: *\1){2,} *$/],
  ["h", /^ {0,3}(#{1,6})[ \t]+/],
  ["quote", /^ {0,3}> ?/],
  ["li", /^([ \t]*)([-*+]|\d{1,9}[.)])[ \t]+/],
];

function el(tag, parent, cls) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  parent.appendChild(e);
  return e;
}

// Lines of src with their offsets: [{start, end (before the newline), next (after it)}].
function lines(src) {
  const out = [];
  let at = 0;
  while (at < src.length) {
    const nl = src.indexOf("\n", at);
    const end = nl < 0 ? src.length : nl;
    out.push({ start: at, end, next: nl < 0 ? end : nl + 1 });
    at = end + 1;
  }
  return out;
}

function kindOf(src, line) {
  const s = src.slice(line.start, line.end);
  if (!s.trim()) return { kind: "blank" };
  if (FENCE.test(s)) return { kind: "fence", m: s.match(FENCE) };
  for (const [kind, re] of BLOCKS) {
    const m = s.match(re);
    if (m) return { kind, m };
  }
  return { kind: "p" };
}

function renderMarkdown(root, src, text) {
  const ls = lines(src);
  let list = null, para = null;
  for (let i = 0; i < ls.length; i++) {
    const line = ls[i], { kind, m } = kindOf(src, line);
    if (kind !== "li" && !(kind === "p" && list && /^\s/.test(src[line.start]))) list = null;
    if (kind !== "p") para = null;
    if (kind === "fence") {
      const pre = el("pre", root), code = el("code", pre);
      if (m[2]) code.dataset.lang = m[2];
      const close = new RegExp("^ {0,3}" + m[1][0] + "{" + m[1].length + ",}\\s*$");
      let j = i + 1;
      while (j < ls.length && !close.test(src.slice(ls[j].start, ls[j].end))) j++;
      if (j > i + 1) text(ls[i + 1].start, j < ls.length ? ls[j - 1].end : src.length, code);
      i = j;
    } else if (kind === "hr") {
      el("hr", root);
    } else if (kind === "h") {
      inline(src, line.start + m[0].length, line.end, el("h" + Math.min(m[1].length + 2, 6), root), text);
    } else if (kind === "quote") {
      inline(src, line.start + m[0].length, line.end, el("blockquote", root), text);
    } else if (kind === "li") {
      const ordered = /\d/.test(m[2]);
      if (!list || list.ordered !== ordered) {
        list = { ordered, el: el(ordered ? "ol" : "ul", root) };
        if (ordered && parseInt(m[2], 10) !== 1) list.el.start = parseInt(m[2], 10);
      }
      const li = el("li", list.el);
      if (m[1].length >= 2) li.classList.add("nested");
      list.last = li;
      inline(src, line.start + m[0].length, line.end, li, text);
    } else if (kind === "p" && list) {  // an indented line continues the list item
      inline(src, line.start, line.end, list.last, text);
    } else if (kind === "p") {
      if (para) text(ls[i - 1].end, line.start, para);  // the newline between a paragraph's lines
      para = para || el("p", root);
      inline(src, line.start, line.end, para, text);
    }
  }
}

// Inline spans of src[a, b) into parent.
function inline(src, a, b, parent, text) {
  let run = a;  // start of plain text not yet emitted
  const flush = (to) => { if (to > run) text(run, to, parent); };
  let i = a;
  while (i < b) {
    const c = src[i];
    let done = null;  // [next index, emit(parent) function] when a span starts at i
    if (c === "`") {
      let n = 0;
      while (src[i + n] === "`") n++;
      const close = src.indexOf("`".repeat(n), i + n);
      if (close >= 0 && close + n <= b && close > i + n) {
        done = [close + n, (p) => text(i + n, close, el("code", p))];
      }
    } else if (c === "*" || c === "_") {  // **strong** or *em*; with _, not inside a word (snake_case)
      const n = src[i + 1] === c ? 2 : 1, mark = c.repeat(n), word = (k) => c === "_" && /\w/.test(src[k] || "");
      const bad = (k) => /\s/.test(src[k - 1]) || word(k + n) || (n === 1 && src[k + 1] === c);
      let close = src.indexOf(mark, i + n);
      while (close >= 0 && close < b && bad(close)) close = src.indexOf(mark, close + (src[close + 1] === c ? 2 : 1));
      if (close > i + n && close + n <= b && !/\s/.test(src[i + n]) && !word(i - 1)) {
        done = [close + n, (p) => inline(src, i + n, close, el(n === 2 ? "strong" : "em", p), text)];
      }
    } else if (c === "[") {
      const mid = src.indexOf("](", i + 1), close = mid < 0 ? -1 : src.indexOf(")", mid + 2);
      if (mid > i && close > mid && close < b && src.lastIndexOf("\n", close) < i) {
        const url = src.slice(mid + 2, close).trim();
        if (SAFE_URL.test(url)) {
          done = [close + 1, (p) => {
            const link = el("a", p);
            link.href = url;
            link.target = "_blank";
            link.rel = "noopener noreferrer nofollow";
            inline(src, i + 1, mid, link, text);
          }];
        }  // any other scheme: left as plain text, so it is shown and inert
      }
    }
    if (done) {
      flush(i);
      done[1](parent);
      i = run = done[0];
    } else {
      i++;
    }
  }
  flush(b);
}
