// Markdown for the chat page: a small renderer of our own that builds DOM nodes and never parses
// HTML. Every piece of the model's text reaches the page as a text node (or an attribute set from
// a checked http(s) URL), so `<script>` or `<img onerror=…>` in an answer shows as those
// characters and runs nothing. What it knows: fenced code blocks (with a copy button), headings,
// lists, block quotes, tables, rules, paragraphs; inline code, bold, italic, strike-through, links.
// Unclosed constructs (an answer still streaming) render as far as they go.
"use strict";

const LilyMarkdown = (() => {
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  // Inline constructs, earliest match first. Groups: 1 code (``…``), 2 code (`…`), 3 bold (**),
  // 4 bold (__), 5 italic (*), 6 italic (_), 7 strike, 8+9 link text and URL, 10 bare URL.
  const INLINE = new RegExp(
    [
      "``([^`][\\s\\S]*?)``",
      "`([^`\\n]+)`",
      "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*",
      "(?<![\\w])__(?=\\S)([\\s\\S]*?\\S)__(?![\\w])",
      "\\*(?=[^\\s*])([^*]*?[^\\s*])\\*",
      "(?<![\\w])_(?=[^\\s_])([^_]*?[^\\s_])_(?![\\w])",
      "~~(?=\\S)([\\s\\S]*?\\S)~~",
      "\\[([^\\]\\n]+)\\]\\((https?:\\/\\/[^\\s)]+)\\)",
      "(https?:\\/\\/[^\\s<>()\\[\\]]*[^\\s<>()\\[\\].,;:!?'\"])",
    ].join("|")
  );

  function el(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function inline(text, parent) {
    let rest = text;
    while (rest) {
      const m = INLINE.exec(rest);
      if (!m) break;
      if (m.index > 0) parent.appendChild(document.createTextNode(rest.slice(0, m.index)));
      if (m[1] !== undefined || m[2] !== undefined) {
        const code = el("code");
        code.textContent = m[1] !== undefined ? m[1] : m[2];
        parent.appendChild(code);
      } else if (m[3] !== undefined || m[4] !== undefined) {
        inline(m[3] !== undefined ? m[3] : m[4], parent.appendChild(el("strong")));
      } else if (m[5] !== undefined || m[6] !== undefined) {
        inline(m[5] !== undefined ? m[5] : m[6], parent.appendChild(el("em")));
      } else if (m[7] !== undefined) {
        inline(m[7], parent.appendChild(el("del")));
      } else {
        const a = el("a");
        a.href = m[9] !== undefined ? m[9] : m[10];
        a.target = "_blank";
        a.rel = "noopener noreferrer";
        if (m[8] !== undefined) inline(m[8], a);
        else a.textContent = m[10];
        parent.appendChild(a);
      }
      rest = rest.slice(m.index + m[0].length);
    }
    if (rest) parent.appendChild(document.createTextNode(rest));
    return parent;
  }

  function copyText(text, button) {
    const done = () => {
      button.textContent = "Copied";
      setTimeout(() => (button.textContent = "Copy"), 1500);
    };
    // The clipboard API needs a secure context (localhost is one; http://some-host is not).
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => fallbackCopy(text) && done());
    } else if (fallbackCopy(text)) {
      done();
    }
  }

  function fallbackCopy(text) {
    const area = el("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "offscreen";
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch (e) {
      ok = false;
    }
    area.remove();
    return ok;
  }

  function codeBlock(body, lang) {
    const box = el("div", "codeblock");
    const head = box.appendChild(el("div", "code-head"));
    head.appendChild(el("span")).textContent = lang || "code";
    const button = head.appendChild(el("button", "copy"));
    button.type = "button";
    button.textContent = "Copy";
    button.addEventListener("click", () => copyText(body, button));
    const code = box.appendChild(el("pre")).appendChild(el("code"));
    if (lang) code.className = "language-" + lang.replace(/[^\w+-]/g, "");
    code.textContent = body;
    return box;
  }

  function cells(line) {
    let row = line.trim();
    if (row.startsWith("|")) row = row.slice(1);
    if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
    return row.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(lines) {
    const t = el("table");
    const head = t.appendChild(el("thead")).appendChild(el("tr"));
    for (const c of cells(lines[0])) inline(c, head.appendChild(el("th")));
    const body = t.appendChild(el("tbody"));
    for (const line of lines.slice(2)) {
      const tr = body.appendChild(el("tr"));
      for (const c of cells(line)) inline(c, tr.appendChild(el("td")));
    }
    return t;
  }

  function startsBlock(lines, i) {
    const line = lines[i];
    return (
      FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]))
    );
  }

  function blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (/^\s*$/.test(line)) {
        i++;
      } else if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const close = new RegExp("^ {0,3}" + fence[0].replace(/[`~]/, "\\$&") + "{" + fence.length + ",}\\s*$");
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        i++; // the closing fence (past the end while the block is still streaming)
        parent.appendChild(codeBlock(body.join("\n"), m[2]));
      } else if ((m = HEADING.exec(line))) {
        inline(m[2], parent.appendChild(el("h" + m[1].length)));
        i++;
      } else if (RULE.test(line)) {
        parent.appendChild(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const quoted = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) quoted.push(lines[i].replace(QUOTE, ""));
        blocks(quoted, parent.appendChild(el("blockquote")));
      } else if ((m = ITEM.exec(line))) {
        i = list(lines, i, parent);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
        const rows = [line, lines[i + 1]];
        for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) rows.push(lines[i]);
        parent.appendChild(table(rows));
      } else {
        const para = [line];
        for (i++; i < lines.length && lines[i].trim() && !startsBlock(lines, i); i++) para.push(lines[i]);
        inline(para.join("\n"), parent.appendChild(el("p")));
      }
    }
    return parent;
  }

  // A list from lines[i]: items of the same kind (bullets or numbers) at the first item's indent;
  // lines indented past it belong to the item (nested lists, continued text). Returns the next line.
  function list(lines, i, parent) {
    const first = ITEM.exec(lines[i]);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const node = parent.appendChild(el(ordered ? "ol" : "ul"));
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    while (i < lines.length) {
      const m = ITEM.exec(lines[i]);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const item = [m[3]];
      for (i++; i < lines.length; i++) {
        const next = lines[i];
        const sub = ITEM.exec(next);
        if (!next.trim()) {
          // A blank line ends the list unless the item or the list goes on after it.
          const after = lines[i + 1];
          if (after === undefined || !(/^\s/.test(after) || ITEM.test(after))) break;
          item.push("");
          continue;
        }
        if (sub && sub[1].length <= indent) break;
        if (!sub && !/^\s/.test(next) && startsBlock(lines, i)) break;
        item.push(next.replace(new RegExp("^ {0," + (indent + 4) + "}"), ""));
      }
      const li = node.appendChild(el("li"));
      if (item.length === 1 || item.slice(1).every((l) => !l.trim())) {
        inline(item[0], li);
      } else {
        blocks(item, li);
        // A tight item (no blank line in it) holds its text bare, as CommonMark renders it.
        if (item.every((l) => l.trim())) {
          for (const p of Array.from(li.children)) if (p.tagName === "P") p.replaceWith(...p.childNodes);
        }
      }
    }
    return i;
  }

  // The DOM of `text` rendered as Markdown, in a fragment.
  function render(text) {
    return blocks(String(text).replace(/\r\n?/g, "\n").split("\n"), document.createDocumentFragment());
  }

  return { render };
})();
